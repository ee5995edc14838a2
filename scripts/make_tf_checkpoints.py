"""Writes tests/data/tf_checkpoints: checkpoints by real TensorFlow, in the original's layout.

Run in the TensorFlow venv (``make .venv-tf/.installed-stamp``), never the default one::

    .venv-tf/bin/python scripts/make_tf_checkpoints.py [--output_dir=tests/data/tf_checkpoints]

What it writes, each with TensorFlow's own ``tf.compat.v1.train.Saver`` (``sharded=True,
save_relative_paths=True``, as tf.estimator's default Saver) into a model_dir of its own:

* ``resnet_tiny/``: the original ``resnet_model.py``'s ResNet v1 built with ``tf.layers`` at the
  root scope (so TensorFlow numbers ``conv2d_N``/``batch_normalization_N`` itself, in creation
  order), two groups of one basic block, 8 filters, 10 classes; Nesterov ``MomentumOptimizer``
  slots after 3 steps; ``global_step`` 3.
* ``resnet_tiny_bottleneck/``: the same with bottleneck blocks.
* ``resnet_tiny_bf16prefix/``: ``resnet_tiny``'s variables under ``bfloat16/`` (TF <= 1.8 runs).
* ``inception_v3_tiny/``: TF-slim's Inception v3 (tf_slim layers and arg_scope, slim's scope
  names and quirks) at depth_multiplier 0.05, min_depth 8, 11 classes (0 = background),
  RMSProp(0.9, momentum 0.9, eps 1.0) slots and ``ExponentialMovingAverage`` shadows of the
  trainable variables and moving statistics after 2 steps.
* ``inception_v4_tiny/``: TF-slim's Inception v4 (slim scopes, AuxLogits/Aux_logits and
  Logits/Logits fully connected heads), thinned like estimax's InceptionV4Tiny (depth 0.05,
  min 8, one block of each kind), 11 classes, ``global_step`` 5. ``--only_inception_v4`` adds
  it to an existing directory.
* ``bert_tiny/``: google-research/bert's ``modeling.py`` graph (2 layers, hidden 8, 2 heads),
  ``bert/...`` and the pre-training ``cls/...`` heads, every variable random; ``--only_bert``
  adds it to an existing directory.
* ``sharded/``: two variables on two CPU devices, so two ``.data-*`` shards.
* ``dtypes/``: one variable of every numeric dtype (bfloat16, int64...); ``strings/`` and
  ``partitioned/``: what the reader refuses.
* ``reference.npz``: the input batches and TensorFlow's own logits (inference mode) for each
  model, so the default test venv needs no TensorFlow.

Batch norm statistics, betas and gammas are set to random values before saving, so an import
that mixed them up could not match.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tf.compat.v1.layers (the original's tf.layers) need the Keras 2 of tf_keras.
os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf1 = tf.compat.v1

# tf_slim 1.1.0 imports tf_keras.legacy_tf_layers, which tf_keras 2.21 keeps under src/.
import tf_keras.src.legacy_tf_layers as _legacy_layers  # noqa: E402

sys.modules.setdefault("tf_keras.legacy_tf_layers", _legacy_layers)
import tf_slim as slim  # noqa: E402

BATCH_NORM_DECAY = 0.9
BATCH_NORM_EPSILON = 1e-5


# ------------------------------------------------------------------ the original resnet_model.py
def batch_norm_relu(inputs, is_training, relu=True, init_zero=False):
    gamma_initializer = tf1.zeros_initializer() if init_zero else tf1.ones_initializer()
    inputs = tf1.layers.batch_normalization(
        inputs=inputs,
        axis=3,
        momentum=BATCH_NORM_DECAY,
        epsilon=BATCH_NORM_EPSILON,
        center=True,
        scale=True,
        training=is_training,
        fused=True,
        gamma_initializer=gamma_initializer,
    )
    if relu:
        inputs = tf.nn.relu(inputs)
    return inputs


def fixed_padding(inputs, kernel_size):
    pad_total = kernel_size - 1
    pad_beg = pad_total // 2
    pad_end = pad_total - pad_beg
    return tf.pad(inputs, [[0, 0], [pad_beg, pad_end], [pad_beg, pad_end], [0, 0]])


def conv2d_fixed_padding(inputs, filters, kernel_size, strides):
    if strides > 1:
        inputs = fixed_padding(inputs, kernel_size)
    return tf1.layers.conv2d(
        inputs=inputs,
        filters=filters,
        kernel_size=kernel_size,
        strides=strides,
        padding=("SAME" if strides == 1 else "VALID"),
        use_bias=False,
        kernel_initializer=tf1.variance_scaling_initializer(),
    )


def residual_block(inputs, filters, is_training, strides, use_projection=False):
    shortcut = inputs
    if use_projection:
        shortcut = conv2d_fixed_padding(inputs, filters, 1, strides)
        shortcut = batch_norm_relu(shortcut, is_training, relu=False)
    inputs = conv2d_fixed_padding(inputs, filters, 3, strides)
    inputs = batch_norm_relu(inputs, is_training)
    inputs = conv2d_fixed_padding(inputs, filters, 3, 1)
    inputs = batch_norm_relu(inputs, is_training, relu=False, init_zero=True)
    return tf.nn.relu(inputs + shortcut)


def bottleneck_block(inputs, filters, is_training, strides, use_projection=False):
    shortcut = inputs
    if use_projection:
        shortcut = conv2d_fixed_padding(inputs, 4 * filters, 1, strides)
        shortcut = batch_norm_relu(shortcut, is_training, relu=False)
    inputs = conv2d_fixed_padding(inputs, filters, 1, 1)
    inputs = batch_norm_relu(inputs, is_training)
    inputs = conv2d_fixed_padding(inputs, filters, 3, strides)
    inputs = batch_norm_relu(inputs, is_training)
    inputs = conv2d_fixed_padding(inputs, 4 * filters, 1, 1)
    inputs = batch_norm_relu(inputs, is_training, relu=False, init_zero=True)
    return tf.nn.relu(inputs + shortcut)


def block_group(inputs, filters, block_fn, blocks, strides, is_training):
    inputs = block_fn(inputs, filters, is_training, strides, use_projection=True)
    for _ in range(1, blocks):
        inputs = block_fn(inputs, filters, is_training, 1)
    return inputs


def resnet_v1(inputs, block_fn, layers, num_classes, is_training, num_filters=64):
    inputs = conv2d_fixed_padding(inputs, num_filters, 7, 2)
    inputs = batch_norm_relu(inputs, is_training)
    inputs = tf1.layers.max_pooling2d(inputs, 3, 2, "SAME")
    for g, blocks in enumerate(layers):
        inputs = block_group(
            inputs, num_filters * 2**g, block_fn, blocks, 1 if g == 0 else 2, is_training
        )
    inputs = tf.reduce_mean(inputs, [1, 2])
    return tf1.layers.dense(
        inputs, num_classes, kernel_initializer=tf1.random_normal_initializer(stddev=0.01)
    )


# ------------------------------------------------------------------ TF-slim's inception_v3
def inception_v3(inputs, num_classes, depth_multiplier, min_depth, scope="InceptionV3"):
    """slim's inception_v3 (inception_v3_base + AuxLogits + Logits), inference mode."""

    def depth(d):
        return max(int(d * depth_multiplier), min_depth)

    conv, avg, mx = slim.conv2d, slim.avg_pool2d, slim.max_pool2d
    end_points = {}
    with tf1.variable_scope(scope, "InceptionV3", [inputs]):
        with slim.arg_scope([conv, mx, avg], stride=1, padding="VALID"):
            net = conv(inputs, depth(32), [3, 3], stride=2, scope="Conv2d_1a_3x3")
            net = conv(net, depth(32), [3, 3], scope="Conv2d_2a_3x3")
            net = conv(net, depth(64), [3, 3], padding="SAME", scope="Conv2d_2b_3x3")
            net = mx(net, [3, 3], stride=2, scope="MaxPool_3a_3x3")
            net = conv(net, depth(80), [1, 1], scope="Conv2d_3b_1x1")
            net = conv(net, depth(192), [3, 3], scope="Conv2d_4a_3x3")
            net = mx(net, [3, 3], stride=2, scope="MaxPool_5a_3x3")
        with slim.arg_scope([conv, mx, avg], stride=1, padding="SAME"):
            for name, pool_d in (("Mixed_5b", 32), ("Mixed_5c", 64), ("Mixed_5d", 64)):
                with tf1.variable_scope(name):
                    with tf1.variable_scope("Branch_0"):
                        b0 = conv(net, depth(64), [1, 1], scope="Conv2d_0a_1x1")
                    with tf1.variable_scope("Branch_1"):
                        if name == "Mixed_5c":
                            b1 = conv(net, depth(48), [1, 1], scope="Conv2d_0b_1x1")
                            b1 = conv(b1, depth(64), [5, 5], scope="Conv_1_0c_5x5")
                        else:
                            b1 = conv(net, depth(48), [1, 1], scope="Conv2d_0a_1x1")
                            b1 = conv(b1, depth(64), [5, 5], scope="Conv2d_0b_5x5")
                    with tf1.variable_scope("Branch_2"):
                        b2 = conv(net, depth(64), [1, 1], scope="Conv2d_0a_1x1")
                        b2 = conv(b2, depth(96), [3, 3], scope="Conv2d_0b_3x3")
                        b2 = conv(b2, depth(96), [3, 3], scope="Conv2d_0c_3x3")
                    with tf1.variable_scope("Branch_3"):
                        b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                        b3 = conv(b3, depth(pool_d), [1, 1], scope="Conv2d_0b_1x1")
                    net = tf.concat([b0, b1, b2, b3], 3)
            with tf1.variable_scope("Mixed_6a"):
                with tf1.variable_scope("Branch_0"):
                    b0 = conv(
                        net, depth(384), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_1x1"
                    )
                with tf1.variable_scope("Branch_1"):
                    b1 = conv(net, depth(64), [1, 1], scope="Conv2d_0a_1x1")
                    b1 = conv(b1, depth(96), [3, 3], scope="Conv2d_0b_3x3")
                    b1 = conv(
                        b1, depth(96), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_1x1"
                    )
                with tf1.variable_scope("Branch_2"):
                    b2 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_1a_3x3")
                net = tf.concat([b0, b1, b2], 3)
            for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160)) + (
                ("Mixed_6e", 192),
            ):
                with tf1.variable_scope(name):
                    with tf1.variable_scope("Branch_0"):
                        b0 = conv(net, depth(192), [1, 1], scope="Conv2d_0a_1x1")
                    with tf1.variable_scope("Branch_1"):
                        b1 = conv(net, depth(c7), [1, 1], scope="Conv2d_0a_1x1")
                        b1 = conv(b1, depth(c7), [1, 7], scope="Conv2d_0b_1x7")
                        b1 = conv(b1, depth(192), [7, 1], scope="Conv2d_0c_7x1")
                    with tf1.variable_scope("Branch_2"):
                        b2 = conv(net, depth(c7), [1, 1], scope="Conv2d_0a_1x1")
                        b2 = conv(b2, depth(c7), [7, 1], scope="Conv2d_0b_7x1")
                        b2 = conv(b2, depth(c7), [1, 7], scope="Conv2d_0c_1x7")
                        b2 = conv(b2, depth(c7), [7, 1], scope="Conv2d_0d_7x1")
                        b2 = conv(b2, depth(192), [1, 7], scope="Conv2d_0e_1x7")
                    with tf1.variable_scope("Branch_3"):
                        b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                        b3 = conv(b3, depth(192), [1, 1], scope="Conv2d_0b_1x1")
                    net = tf.concat([b0, b1, b2, b3], 3)
            end_points["Mixed_6e"] = net
            with tf1.variable_scope("Mixed_7a"):
                with tf1.variable_scope("Branch_0"):
                    b0 = conv(net, depth(192), [1, 1], scope="Conv2d_0a_1x1")
                    b0 = conv(
                        b0, depth(320), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3"
                    )
                with tf1.variable_scope("Branch_1"):
                    b1 = conv(net, depth(192), [1, 1], scope="Conv2d_0a_1x1")
                    b1 = conv(b1, depth(192), [1, 7], scope="Conv2d_0b_1x7")
                    b1 = conv(b1, depth(192), [7, 1], scope="Conv2d_0c_7x1")
                    b1 = conv(
                        b1, depth(192), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3"
                    )
                with tf1.variable_scope("Branch_2"):
                    b2 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_1a_3x3")
                net = tf.concat([b0, b1, b2], 3)
            for name in ("Mixed_7b", "Mixed_7c"):
                with tf1.variable_scope(name):
                    with tf1.variable_scope("Branch_0"):
                        b0 = conv(net, depth(320), [1, 1], scope="Conv2d_0a_1x1")
                    with tf1.variable_scope("Branch_1"):
                        b1 = conv(net, depth(384), [1, 1], scope="Conv2d_0a_1x1")
                        second = "Conv2d_0b_3x1" if name == "Mixed_7b" else "Conv2d_0c_3x1"
                        b1 = tf.concat(
                            [
                                conv(b1, depth(384), [1, 3], scope="Conv2d_0b_1x3"),
                                conv(b1, depth(384), [3, 1], scope=second),
                            ],
                            3,
                        )
                    with tf1.variable_scope("Branch_2"):
                        b2 = conv(net, depth(448), [1, 1], scope="Conv2d_0a_1x1")
                        b2 = conv(b2, depth(384), [3, 3], scope="Conv2d_0b_3x3")
                        b2 = tf.concat(
                            [
                                conv(b2, depth(384), [1, 3], scope="Conv2d_0c_1x3"),
                                conv(b2, depth(384), [3, 1], scope="Conv2d_0d_3x1"),
                            ],
                            3,
                        )
                    with tf1.variable_scope("Branch_3"):
                        b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                        b3 = conv(b3, depth(192), [1, 1], scope="Conv2d_0b_1x1")
                    net = tf.concat([b0, b1, b2, b3], 3)
        with slim.arg_scope([conv, mx, avg], stride=1, padding="SAME"):
            with tf1.variable_scope("AuxLogits"):
                aux = avg(
                    end_points["Mixed_6e"],
                    [5, 5],
                    stride=3,
                    padding="VALID",
                    scope="AvgPool_1a_5x5",
                )
                aux = conv(aux, depth(128), [1, 1], scope="Conv2d_1b_1x1")
                shape = aux.get_shape().as_list()
                k = [min(shape[1], 5), min(shape[2], 5)]
                aux = conv(
                    aux,
                    depth(768),
                    k,
                    weights_initializer=tf1.truncated_normal_initializer(stddev=0.01),
                    padding="VALID",
                    scope="Conv2d_2a_{}x{}".format(*k),
                )
                aux = conv(
                    aux,
                    num_classes,
                    [1, 1],
                    activation_fn=None,
                    normalizer_fn=None,
                    weights_initializer=tf1.truncated_normal_initializer(stddev=0.001),
                    scope="Conv2d_2b_1x1",
                )
                aux = tf.squeeze(aux, [1, 2])
            with tf1.variable_scope("Logits"):
                shape = net.get_shape().as_list()
                net = avg(net, [shape[1], shape[2]], padding="VALID", scope="AvgPool_1a")
                logits = conv(
                    net,
                    num_classes,
                    [1, 1],
                    activation_fn=None,
                    normalizer_fn=None,
                    scope="Conv2d_1c_1x1",
                )
                logits = tf.squeeze(logits, [1, 2])
    return logits, aux


def inception_arg_scope(decay=0.996):
    """slim's inception arg_scope as the originals pass it (BN decay 0.996 v3, 0.995 v4)."""
    return slim.arg_scope(
        [slim.conv2d],
        weights_initializer=slim.variance_scaling_initializer(),
        activation_fn=tf.nn.relu,
        normalizer_fn=slim.batch_norm,
        normalizer_params={
            "decay": decay,
            "epsilon": 1e-3,
            "scale": False,
            "is_training": False,
            "fused": True,
        },
    )


# ------------------------------------------------------------------ TF-slim's inception_v4
def inception_v4(inputs, num_classes, depth_multiplier, min_depth, repeats, scope="InceptionV4"):
    """slim's inception_v4 (+ AuxLogits, Logits), inference mode; ``depth_multiplier`` and
    ``repeats`` thin it as estimax's InceptionV4Tiny does (slim's v4 has no multiplier)."""

    def d(n):
        return max(int(n * depth_multiplier), min_depth)

    conv, avg, mx = slim.conv2d, slim.avg_pool2d, slim.max_pool2d
    vs = tf1.variable_scope

    def block_a(net, name):
        with vs(name):
            with vs("Branch_0"):
                b0 = conv(net, d(96), [1, 1], scope="Conv2d_0a_1x1")
            with vs("Branch_1"):
                b1 = conv(net, d(64), [1, 1], scope="Conv2d_0a_1x1")
                b1 = conv(b1, d(96), [3, 3], scope="Conv2d_0b_3x3")
            with vs("Branch_2"):
                b2 = conv(net, d(64), [1, 1], scope="Conv2d_0a_1x1")
                b2 = conv(b2, d(96), [3, 3], scope="Conv2d_0b_3x3")
                b2 = conv(b2, d(96), [3, 3], scope="Conv2d_0c_3x3")
            with vs("Branch_3"):
                b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                b3 = conv(b3, d(96), [1, 1], scope="Conv2d_0b_1x1")
            return tf.concat([b0, b1, b2, b3], 3)

    def block_b(net, name):
        with vs(name):
            with vs("Branch_0"):
                b0 = conv(net, d(384), [1, 1], scope="Conv2d_0a_1x1")
            with vs("Branch_1"):
                b1 = conv(net, d(192), [1, 1], scope="Conv2d_0a_1x1")
                b1 = conv(b1, d(224), [1, 7], scope="Conv2d_0b_1x7")
                b1 = conv(b1, d(256), [7, 1], scope="Conv2d_0c_7x1")
            with vs("Branch_2"):
                b2 = conv(net, d(192), [1, 1], scope="Conv2d_0a_1x1")
                b2 = conv(b2, d(192), [7, 1], scope="Conv2d_0b_7x1")
                b2 = conv(b2, d(224), [1, 7], scope="Conv2d_0c_1x7")
                b2 = conv(b2, d(224), [7, 1], scope="Conv2d_0d_7x1")
                b2 = conv(b2, d(256), [1, 7], scope="Conv2d_0e_1x7")
            with vs("Branch_3"):
                b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                b3 = conv(b3, d(128), [1, 1], scope="Conv2d_0b_1x1")
            return tf.concat([b0, b1, b2, b3], 3)

    def block_c(net, name):
        with vs(name):
            with vs("Branch_0"):
                b0 = conv(net, d(256), [1, 1], scope="Conv2d_0a_1x1")
            with vs("Branch_1"):
                b1 = conv(net, d(384), [1, 1], scope="Conv2d_0a_1x1")
                b1 = tf.concat(
                    [
                        conv(b1, d(256), [1, 3], scope="Conv2d_0b_1x3"),
                        conv(b1, d(256), [3, 1], scope="Conv2d_0c_3x1"),
                    ],
                    3,
                )
            with vs("Branch_2"):
                b2 = conv(net, d(384), [1, 1], scope="Conv2d_0a_1x1")
                b2 = conv(b2, d(448), [3, 1], scope="Conv2d_0b_3x1")
                b2 = conv(b2, d(512), [1, 3], scope="Conv2d_0c_1x3")
                b2 = tf.concat(
                    [
                        conv(b2, d(256), [1, 3], scope="Conv2d_0d_1x3"),
                        conv(b2, d(256), [3, 1], scope="Conv2d_0e_3x1"),
                    ],
                    3,
                )
            with vs("Branch_3"):
                b3 = avg(net, [3, 3], scope="AvgPool_0a_3x3")
                b3 = conv(b3, d(256), [1, 1], scope="Conv2d_0b_1x1")
            return tf.concat([b0, b1, b2, b3], 3)

    with vs(scope):
        with slim.arg_scope([conv, mx, avg], stride=1, padding="SAME"):
            net = conv(inputs, d(32), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
            net = conv(net, d(32), [3, 3], padding="VALID", scope="Conv2d_2a_3x3")
            net = conv(net, d(64), [3, 3], scope="Conv2d_2b_3x3")
            with vs("Mixed_3a"):
                with vs("Branch_0"):
                    b0 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_0a_3x3")
                with vs("Branch_1"):
                    b1 = conv(net, d(96), [3, 3], stride=2, padding="VALID", scope="Conv2d_0a_3x3")
                net = tf.concat([b0, b1], 3)
            with vs("Mixed_4a"):
                with vs("Branch_0"):
                    b0 = conv(net, d(64), [1, 1], scope="Conv2d_0a_1x1")
                    b0 = conv(b0, d(96), [3, 3], padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_1"):
                    b1 = conv(net, d(64), [1, 1], scope="Conv2d_0a_1x1")
                    b1 = conv(b1, d(64), [1, 7], scope="Conv2d_0b_1x7")
                    b1 = conv(b1, d(64), [7, 1], scope="Conv2d_0c_7x1")
                    b1 = conv(b1, d(96), [3, 3], padding="VALID", scope="Conv2d_1a_3x3")
                net = tf.concat([b0, b1], 3)
            with vs("Mixed_5a"):
                with vs("Branch_0"):
                    b0 = conv(net, d(192), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_1"):
                    b1 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_1a_3x3")
                net = tf.concat([b0, b1], 3)
            for i in range(repeats[0]):
                net = block_a(net, "Mixed_5" + "bcde"[i])
            with vs("Mixed_6a"):
                with vs("Branch_0"):
                    b0 = conv(net, d(384), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_1"):
                    b1 = conv(net, d(192), [1, 1], scope="Conv2d_0a_1x1")
                    b1 = conv(b1, d(224), [3, 3], scope="Conv2d_0b_3x3")
                    b1 = conv(b1, d(256), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_2"):
                    b2 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_1a_3x3")
                net = tf.concat([b0, b1, b2], 3)
            for i in range(repeats[1]):
                net = block_b(net, "Mixed_6" + "bcdefgh"[i])
            with vs("AuxLogits"):
                aux = avg(net, [5, 5], stride=3, padding="VALID", scope="AvgPool_1a_5x5")
                aux = conv(aux, d(128), [1, 1], scope="Conv2d_1b_1x1")
                aux = conv(aux, d(768), aux.get_shape()[1:3], padding="VALID", scope="Conv2d_2a")
                aux = slim.flatten(aux)
                aux = slim.fully_connected(aux, num_classes, activation_fn=None, scope="Aux_logits")
            with vs("Mixed_7a"):
                with vs("Branch_0"):
                    b0 = conv(net, d(192), [1, 1], scope="Conv2d_0a_1x1")
                    b0 = conv(b0, d(192), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_1"):
                    b1 = conv(net, d(256), [1, 1], scope="Conv2d_0a_1x1")
                    b1 = conv(b1, d(256), [1, 7], scope="Conv2d_0b_1x7")
                    b1 = conv(b1, d(320), [7, 1], scope="Conv2d_0c_7x1")
                    b1 = conv(b1, d(320), [3, 3], stride=2, padding="VALID", scope="Conv2d_1a_3x3")
                with vs("Branch_2"):
                    b2 = mx(net, [3, 3], stride=2, padding="VALID", scope="MaxPool_1a_3x3")
                net = tf.concat([b0, b1, b2], 3)
            for i in range(repeats[2]):
                net = block_c(net, "Mixed_7" + "bcd"[i])
            with vs("Logits"):
                net = avg(net, net.get_shape()[1:3], padding="VALID", scope="AvgPool_1a")
                net = slim.flatten(net, scope="PreLogitsFlatten")
                logits = slim.fully_connected(net, num_classes, activation_fn=None, scope="Logits")
    return logits, aux


def make_inception_v4(out, rng, refs):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(int(rng.integers(1 << 30)))
        x = tf1.placeholder(tf.float32, [None, 112, 112, 3])
        with inception_arg_scope(decay=0.995):
            logits, aux = inception_v4(x, 11, 0.05, 8, (1, 1, 1))
        global_step = tf1.train.get_or_create_global_step()
        pixels = rng.integers(0, 256, (2, 112, 112, 3), dtype=np.uint8)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            _randomize(sess, rng, tf1.global_variables())
            global_step.load(5, sess)
            _save(sess, os.path.join(out, "inception_v4_tiny"), None, global_step)
            refs["inception_v4_tiny/pixels"] = pixels
            refs["inception_v4_tiny/logits"], refs["inception_v4_tiny/aux_logits"] = sess.run(
                [logits, aux], {x: to_float(pixels)}
            )


# ------------------------------------------------------------------ BERT (google-research/bert)
# modeling.py's graph, thinned: the variable names run_classifier.py's users warm-start from.
BERT = {"vocab": 16, "hidden": 8, "heads": 2, "intermediate": 16, "layers": 2, "positions": 8}


def bert_layer_norm(x):
    # modeling.py: tf.contrib.layers.layer_norm (gone in TF 2; tf_slim's is the same layer).
    return slim.layer_norm(x, begin_norm_axis=-1, begin_params_axis=-1, scope="LayerNorm")


def bert_gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * tf.pow(x, 3))))


def bert_model(input_ids, token_type_ids, input_mask):
    """modeling.BertModel's variables and forward pass; returns (sequence output, pooled)."""
    c = BERT
    h, heads = c["hidden"], c["heads"]
    size = h // heads
    init = tf1.truncated_normal_initializer(stddev=0.02)
    batch, length = input_ids.shape[0], input_ids.shape[1]
    with tf1.variable_scope("bert"):
        with tf1.variable_scope("embeddings"):
            words = tf1.get_variable("word_embeddings", [c["vocab"], h], initializer=init)
            x = tf.gather(words, input_ids)
            types = tf1.get_variable("token_type_embeddings", [2, h], initializer=init)
            x += tf.gather(types, token_type_ids)
            positions = tf1.get_variable(
                "position_embeddings", [c["positions"], h], initializer=init
            )
            x += positions[None, :length]
            x = bert_layer_norm(x)
        mask = (1.0 - tf.cast(input_mask[:, None, None, :], tf.float32)) * -10000.0
        with tf1.variable_scope("encoder"):
            for i in range(c["layers"]):
                with tf1.variable_scope(f"layer_{i}"):
                    with tf1.variable_scope("attention"):
                        with tf1.variable_scope("self"):

                            def heads_of(name, x=x):
                                y = tf1.layers.dense(x, h, name=name, kernel_initializer=init)
                                return tf.transpose(
                                    tf.reshape(y, [batch, length, heads, size]), [0, 2, 1, 3]
                                )

                            q, k, v = heads_of("query"), heads_of("key"), heads_of("value")
                            scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(size) + mask
                            context = tf.matmul(tf.nn.softmax(scores), v)
                            context = tf.reshape(
                                tf.transpose(context, [0, 2, 1, 3]), [batch, length, h]
                            )
                        with tf1.variable_scope("output"):
                            attended = tf1.layers.dense(context, h, kernel_initializer=init)
                            attended = bert_layer_norm(attended + x)
                    with tf1.variable_scope("intermediate"):
                        inner = tf1.layers.dense(
                            attended,
                            c["intermediate"],
                            activation=bert_gelu,
                            kernel_initializer=init,
                        )
                    with tf1.variable_scope("output"):
                        out = tf1.layers.dense(inner, h, kernel_initializer=init)
                        x = bert_layer_norm(out + attended)
        with tf1.variable_scope("pooler"):
            pooled = tf1.layers.dense(x[:, 0], h, activation=tf.tanh, kernel_initializer=init)
    return x, pooled


def make_bert(out, rng, refs):
    """``bert_tiny/``: a pre-training checkpoint's names (``bert/...`` and the ``cls/`` heads a
    classifier leaves unused), every variable random, ``global_step`` 7; TensorFlow's own values
    of every variable and of its outputs in ``reference.npz``."""
    c = BERT
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(int(rng.integers(1 << 30)))
        ids = tf1.placeholder(tf.int32, [2, 5])
        types = tf1.placeholder(tf.int32, [2, 5])
        mask = tf1.placeholder(tf.int32, [2, 5])
        sequence, pooled = bert_model(ids, types, mask)
        # run_pretraining.py's heads: not a classifier's (unused by its warm start).
        with tf1.variable_scope("cls/predictions"):
            tf1.get_variable("output_bias", [c["vocab"]], initializer=tf1.zeros_initializer())
        with tf1.variable_scope("cls/seq_relationship"):
            tf1.get_variable("output_weights", [2, c["hidden"]])
            tf1.get_variable("output_bias", [2], initializer=tf1.zeros_initializer())
        global_step = tf1.train.get_or_create_global_step()
        feed = {
            ids: rng.integers(0, c["vocab"], (2, 5)).astype(np.int32),
            types: rng.integers(0, 2, (2, 5)).astype(np.int32),
            mask: np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32),
        }
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            # Random values everywhere (biases, gammas, betas too): a rename that swapped two
            # variables of one shape could not then match.
            for v in tf1.global_variables():
                if v.op.name != "global_step":
                    v.load(rng.normal(0.0, 0.5, v.get_shape().as_list()).astype(np.float32), sess)
            global_step.load(7, sess)
            _save(sess, os.path.join(out, "bert_tiny"), None, global_step)
            # TensorFlow's own values, one flat vector in name order (an .npz entry per
            # variable would cost more headers than values).
            variables = sorted(tf1.global_variables(), key=lambda v: v.op.name)
            refs["bert_tiny/names"] = np.array([v.op.name for v in variables])
            refs["bert_tiny/values"] = np.concatenate(
                [np.ravel(sess.run(v)).astype(np.float64) for v in variables]
            )
            for key, placeholder in (
                ("input_ids", ids),
                ("token_type_ids", types),
                ("input_mask", mask),
            ):
                refs[f"bert_tiny/{key}"] = feed[placeholder]
            refs["bert_tiny/sequence_output"], refs["bert_tiny/pooled_output"] = sess.run(
                [sequence, pooled], feed
            )


# ------------------------------------------------------------------ writing
def to_float(pixels):
    """The models' input from uint8 pixels (the .npz keeps the pixels: 4x smaller)."""
    return (pixels.astype(np.float32) / 127.5 - 1.0).astype(np.float32)


def _randomize(sess, rng, variables):
    """Random non-trivial values for BN stats, betas, gammas (a mix-up cannot then match)."""
    for v in variables:
        name = v.op.name
        shape = v.get_shape().as_list()
        if name.endswith(("moving_variance",)):
            value = rng.uniform(0.5, 2.0, shape)
        elif name.endswith(("moving_mean", "beta")):
            value = rng.normal(0.0, 0.2, shape)
        elif name.endswith("gamma"):
            value = rng.uniform(0.5, 1.5, shape)
        else:
            continue
        v.load(value.astype(np.float32), sess)


def _save(sess, model_dir, var_list, step):
    shutil.rmtree(model_dir, ignore_errors=True)
    os.makedirs(model_dir)
    saver = tf1.train.Saver(var_list=var_list, sharded=True, save_relative_paths=True)
    # No .meta: the graph is not needed for the weights (and would be most of the bytes).
    saver.save(
        sess, os.path.join(model_dir, "model.ckpt"), global_step=step, write_meta_graph=False
    )


def make_resnet(out, name, block_fn, rng, refs, prefixed_copy=None):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(int(rng.integers(1 << 30)))
        x = tf1.placeholder(tf.float32, [None, 32, 32, 3])
        labels = tf1.placeholder(tf.int32, [None])
        logits = resnet_v1(x, block_fn, [1, 1], num_classes=10, is_training=False, num_filters=8)
        global_step = tf1.train.get_or_create_global_step()
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        train_op = tf1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True).minimize(
            loss, global_step=global_step
        )
        pixels = rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
        images = to_float(pixels)
        targets = rng.integers(0, 10, 4).astype(np.int32)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(3):
                sess.run(train_op, {x: images, labels: targets})
            _randomize(sess, rng, tf1.global_variables())
            _save(sess, os.path.join(out, name), None, global_step)
            refs[f"{name}/pixels"] = pixels
            refs[f"{name}/logits"] = sess.run(logits, {x: images})
            if prefixed_copy:
                var_list = {
                    (v.op.name if v.op.name == "global_step" else "bfloat16/" + v.op.name): v
                    for v in tf1.global_variables()
                }
                _save(sess, os.path.join(out, prefixed_copy), var_list, global_step)


def make_inception_v3(out, rng, refs):
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(int(rng.integers(1 << 30)))
        x = tf1.placeholder(tf.float32, [None, 112, 112, 3])
        labels = tf1.placeholder(tf.int32, [None])
        with inception_arg_scope():
            logits, aux = inception_v3(x, num_classes=11, depth_multiplier=0.05, min_depth=8)
        global_step = tf1.train.get_or_create_global_step()
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        loss += 0.4 * tf1.losses.sparse_softmax_cross_entropy(labels, aux)
        opt = tf1.train.RMSPropOptimizer(0.01, decay=0.9, momentum=0.9, epsilon=1.0)
        minimize = opt.minimize(loss, global_step=global_step)
        ema = tf1.train.ExponentialMovingAverage(0.995, num_updates=global_step)
        with tf.control_dependencies([minimize]):
            train_op = ema.apply(tf1.trainable_variables() + tf1.moving_average_variables())
        pixels = rng.integers(0, 256, (2, 112, 112, 3), dtype=np.uint8)
        images = to_float(pixels)
        targets = rng.integers(0, 11, 2).astype(np.int32)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op, {x: images, labels: targets})
            _randomize(sess, rng, tf1.global_variables())
            # Shadows of the statistics a little off the statistics, so using one for the other
            # would show.
            for v in tf1.moving_average_variables():
                shadow = ema.average(v)
                shadow.load(sess.run(v) * 1.05 + 0.01, sess)
            _save(sess, os.path.join(out, "inception_v3_tiny"), None, global_step)
            refs["inception_v3_tiny/pixels"] = pixels
            refs["inception_v3_tiny/logits"], refs["inception_v3_tiny/aux_logits"] = sess.run(
                [logits, aux], {x: images}
            )
            # The original evaluates the moving averages (ema.variables_to_restore()).
            for v in tf1.trainable_variables() + tf1.moving_average_variables():
                v.load(sess.run(ema.average(v)), sess)
            refs["inception_v3_tiny/ema_logits"] = sess.run(logits, {x: images})


def make_dtypes(out, rng):
    graph = tf.Graph()
    with graph.as_default():
        values = {
            "float32": rng.normal(size=(3, 2)).astype(np.float32),
            "float64": rng.normal(size=(2,)),
            "float16": rng.normal(size=(2, 2)).astype(np.float16),
            "bfloat16": rng.normal(size=(5,)).astype(np.float32),
            "int8": np.array([-3, 4], np.int8),
            "int16": np.array([-300, 4], np.int16),
            "int32": np.array([[1, -2], [3, 4]], np.int32),
            "int64": np.array([1 << 40, -7], np.int64),
            "uint8": np.array([0, 255], np.uint8),
            "uint16": np.array([65535], np.uint16),
            "bool": np.array([True, False, True]),
            "complex64": np.array([1 + 2j], np.complex64),
            "scalar": np.float32(2.5),
        }
        variables = []
        for name, value in values.items():
            dtype = tf.bfloat16 if name == "bfloat16" else None
            variables.append(
                tf1.get_variable(
                    f"dtypes/{name}",
                    initializer=tf.constant(value, dtype=dtype),
                    use_resource=False,
                )
            )
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            _save(sess, os.path.join(out, "dtypes"), None, None)
            saved = {v.op.name: sess.run(v) for v in variables}
    return saved


def make_sharded(out, rng):
    """Variables on two CPU devices: the sharded Saver writes one .data file per device."""
    graph = tf.Graph()
    values = {}
    with graph.as_default():
        for i in range(2):
            with tf.device(f"/cpu:{i}"):
                value = rng.normal(size=(3, i + 2)).astype(np.float32)
                tf1.get_variable(f"on_cpu{i}", initializer=value, use_resource=False)
                values[f"sharded/on_cpu{i}"] = value
        config = tf1.ConfigProto(device_count={"CPU": 2})
        with tf1.Session(graph=graph, config=config) as sess:
            sess.run(tf1.global_variables_initializer())
            _save(sess, os.path.join(out, "sharded"), None, None)
    return values


def make_refused(out):
    graph = tf.Graph()
    with graph.as_default():
        tf1.get_variable("words", initializer=tf.constant(["a", "bc"]), use_resource=False)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            _save(sess, os.path.join(out, "strings"), None, None)
    graph = tf.Graph()
    with graph.as_default():
        tf1.get_variable(
            "sliced",
            shape=[4, 2],
            partitioner=tf1.fixed_size_partitioner(2),
            initializer=tf1.ones_initializer(),
        )
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            _save(sess, os.path.join(out, "partitioned"), None, None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="tests/data/tf_checkpoints")
    parser.add_argument(
        "--only_inception_v4",
        action="store_true",
        help="add inception_v4_tiny (and its references) to an existing --output_dir",
    )
    parser.add_argument(
        "--only_sharded",
        action="store_true",
        help="add sharded/ (and its references) to an existing --output_dir",
    )
    parser.add_argument(
        "--only_bert",
        action="store_true",
        help="add bert_tiny/ (and its references) to an existing --output_dir",
    )
    args = parser.parse_args()
    tf1.disable_eager_execution()
    os.makedirs(args.output_dir, exist_ok=True)
    rng = np.random.default_rng(20260524)
    refs: dict[str, np.ndarray] = {}
    if args.only_bert:
        path = os.path.join(args.output_dir, "reference.npz")
        refs = dict(np.load(path))
        make_bert(args.output_dir, np.random.default_rng(20260601), refs)
        np.savez(path, **refs)
        print(f"added bert_tiny to {args.output_dir}")
        return
    if args.only_sharded:
        path = os.path.join(args.output_dir, "reference.npz")
        refs = dict(np.load(path))
        refs.update(make_sharded(args.output_dir, np.random.default_rng(20260526)))
        np.savez(path, **refs)
        print(f"added sharded to {args.output_dir}")
        return
    if args.only_inception_v4:
        path = os.path.join(args.output_dir, "reference.npz")
        refs = dict(np.load(path))
        make_inception_v4(args.output_dir, np.random.default_rng(20260525), refs)
        np.savez(path, **refs)
        print(f"added inception_v4_tiny to {args.output_dir}")
        return
    make_resnet(args.output_dir, "resnet_tiny", residual_block, rng, refs, "resnet_tiny_bf16prefix")
    make_resnet(args.output_dir, "resnet_tiny_bottleneck", bottleneck_block, rng, refs)
    make_inception_v3(args.output_dir, rng, refs)
    for name, value in make_dtypes(args.output_dir, rng).items():
        value = np.asarray(value)
        # npz has no bfloat16: its bits, as uint16.
        refs[name] = value.view(np.uint16) if value.dtype.name == "bfloat16" else value
    make_refused(args.output_dir)
    make_inception_v4(args.output_dir, np.random.default_rng(20260525), refs)
    refs.update(make_sharded(args.output_dir, np.random.default_rng(20260526)))
    make_bert(args.output_dir, np.random.default_rng(20260601), refs)
    refs["tensorflow_version"] = np.array(tf.__version__)
    np.savez(os.path.join(args.output_dir, "reference.npz"), **refs)
    print(f"wrote {args.output_dir} with TensorFlow {tf.__version__}")


if __name__ == "__main__":
    main()
