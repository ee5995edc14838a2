"""Tests of the Flax reference models (estimax.models): ResNet, Inception v3/v4, EfficientNet, ViT.

Compute is kept cheap: parameter counts use ``jax.eval_shape`` at the real input sizes (no
FLOPs, no compile); the numeric checks (NaN, gradients, train/eval behaviour) run at batch 2 on
the thin ``*_tiny`` variants -- which run every block type of their family -- plus ResNet-18 and
ResNet-50 at 32x32. Full-depth Inception/ResNet-152/200 gradients take minutes to compile on
this 2-core CPU and add no code path the tiny variants do not already run.
"""

from __future__ import annotations

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from estimax.models import MODELS, efficientnet, get_model, resnet, resnet_v1, vit
from estimax.models import inception_v3 as v3
from estimax.models import inception_v4 as v4

# XLA:CPU spends ~45 s optimising an Inception gradient at the default level on 2 shared cores;
# level 0 compiles in ~9 s and computes the same values (only slower to run, irrelevant here).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def _num(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _shapes(model: nn.Module, size: int):
    """Variable shapes of ``model`` for a ``[1, size, size, 3]`` input, without computing."""
    return jax.eval_shape(
        lambda: model.init(
            {"params": jax.random.key(0), "dropout": jax.random.key(1)},
            jnp.zeros((1, size, size, 3)),
            train=False,
        )
    )


def _image_size(name: str) -> int:
    if name.startswith("efficientnet_b"):  # the variant's resolution (224 for B0 .. 600 for B7)
        return efficientnet.EFFICIENTNETS[name.replace("_", "-")][1]
    if name == "vit_tiny":
        return vit.TINY_RESOLUTION
    return 299 if name.startswith("inception") else 224


# --------------------------------------------------------------------------------------------
# Parameter counts: every full-size registered model against a published number.
#
# torchvision's documented ``num_params`` (torchvision.models weights tables), 1000 classes:
#   resnet18 11,689,512; resnet34 21,797,672; resnet50 25,557,032; resnet101 44,549,160;
#   resnet152 60,192,808 -- the same v1.5 layout as the original (stride on the 3x3).
# ResNet-200: timm ``resnet200`` (layers [3, 24, 36, 3], same layout), 64,673,832 counted by
#   instantiating timm 1.0.31; it also equals _resnet_formula below.
# The original adds a projection shortcut to the first block of *every* group, also in group 1
#   of ResNet-18/34 where torchvision has an identity: +1x1 conv 64x64 + BN (gamma, beta)
#   = 4,096 + 128 = 4,224 parameters. ``always_project=False`` is torchvision's layout.
# Inception v3: torchvision ``inception_v3`` 27,161,264 (1000 classes, aux head, BN with a learned
#   scale) and Keras ``InceptionV3`` "Total params: 23,851,784" / "Trainable params: 23,817,352"
#   (1000 classes, no aux head, BN scale=False as slim; Keras's total also counts BN moving
#   mean/variance, our ``batch_stats``).
# Inception v4: timm ``inception_v4`` 42,679,816 (1000 classes, no aux head, BN with scale;
#   timm's model card: 42.7 M).
# EfficientNet B0-B7: torchvision's documented ``num_params`` (efficientnet_b0 .. b7, weights
#   "ported from the original paper"), the original's layout: B0 5,288,548 (Keras's
#   EfficientNetB0 trainable params are the same number).
# ViT-S/16, B/16, L/16: timm's vit_small_patch16_224 22,050,664, vit_base_patch16_224
#   86,567,656 and vit_large_patch16_224 304,326,632 (timm's model cards: 22.1 M, 86.6 M, 304.3 M;
#   the ViT paper's Table 1: 86 M and 307 M), in the paper's layout: class token, learned
#   position embeddings, no pre-logits layer (``vit.PAPER_LAYOUT``). big_vision, whose model
#   estimax follows, adds the position embeddings before the class token is prepended, so it has
#   one position embedding (``width`` parameters) fewer than timm's 197: published - width.
#   The registry's defaults are big_vision's ImageNet heads; tests/test_vit.py checks those.
# --------------------------------------------------------------------------------------------
TORCHVISION_LAYOUT_PROJECTION = 64 * 64 + 2 * 64

PUBLISHED = {
    # registry name: (constructor overrides giving the published configuration, count)
    "resnet18": ({"always_project": False}, 11_689_512),
    "resnet34": ({"always_project": False}, 21_797_672),
    "resnet50": ({}, 25_557_032),
    "resnet101": ({}, 44_549_160),
    "resnet152": ({}, 60_192_808),
    "resnet200": ({}, 64_673_832),
    "inception_v3": ({"num_classes": 1000, "bn_scale": True}, 27_161_264),
    "inception_v4": ({"num_classes": 1000, "aux_logits": False, "bn_scale": True}, 42_679_816),
    "efficientnet_b0": ({}, 5_288_548),
    "efficientnet_b1": ({}, 7_794_184),
    "efficientnet_b2": ({}, 9_109_994),
    "efficientnet_b3": ({}, 12_233_232),
    "efficientnet_b4": ({}, 19_341_616),
    "efficientnet_b5": ({}, 30_389_784),
    "efficientnet_b6": ({}, 43_040_704),
    "efficientnet_b7": ({}, 66_347_960),
    "vit_s16": (vit.PAPER_LAYOUT, 22_050_664 - 384),
    "vit_b16": (vit.PAPER_LAYOUT, 86_567_656 - 768),
    "vit_l16": (vit.PAPER_LAYOUT, 304_326_632 - 1024),
}
# Registered models checked numerically in their own family's tests.
CHECKED_ELSEWHERE = {"vit_tiny": "tests/test_vit.py"}


@functools.cache
def _real_size_trace(name: str):
    """(variable shapes, train-mode outputs) of the registry's ``name`` at its real size, batch
    2, from one trace (``eval_shape``: nothing computed). Tracing a full-size model costs
    seconds of Python; the count, formula and output-shape tests read this one trace."""
    model = get_model(name)
    size = _image_size(name)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}

    def init_and_train_forward(x):
        variables = model.init(rngs, x, train=False)
        out = model.apply(variables, x, train=True, mutable=["batch_stats"], rngs=rngs)[0]
        return variables, out

    return jax.eval_shape(init_and_train_forward, x)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_equals_published(name):
    overrides, expected = PUBLISHED[name]
    if overrides:
        shapes = _shapes(get_model(name, **overrides), _image_size(name))
    else:  # the registry's model as it is: the trace the output-shape test below reads too
        shapes = _real_size_trace(name)[0]
    assert _num(shapes["params"]) == expected


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_registered_model_output_shapes_at_its_real_size(name):
    # Shapes only (eval_shape: traced, not run): [B, num_classes] float32 logits in train mode,
    # plus the aux logits for the Inceptions; the registry's default classes. (Eval mode runs
    # the same layers; it is checked numerically on the tiny variants below.)
    num_classes = 1001 if name.startswith("inception") else 1000
    out = _real_size_trace(name)[1]
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == (2 if name.startswith("inception") else 1)
    for logits in outs:
        assert logits.shape == (2, num_classes) and logits.dtype == jnp.float32


def test_every_registered_model_is_checked():
    # A model added to the registry must get a published count or a numeric run here.
    assert set(MODELS) <= set(PUBLISHED) | set(NUMERIC) | set(CHECKED_ELSEWHERE)


def test_resnet18_34_original_layout_adds_group1_projection():
    for depth, published in ((18, 11_689_512), (34, 21_797_672)):
        count = _num(_shapes(resnet_v1(depth), 224)["params"])
        assert count == published + TORCHVISION_LAYOUT_PROJECTION


def test_vit_recipe_heads_derived_from_published():
    # The registry's ViTs carry big_vision's ImageNet heads. From the paper layout (published -
    # width, above): ViT-S/16 (vit_s16_i1k.py) drops the 196 learned position embeddings
    # (sincos2d) and the class token (gap) and adds pre_logits (width x width + width); B/16 and
    # L/16 (vit_i1k.py) keep both and add pre_logits.
    for name, width, published, s16 in (
        ("vit_s16", 384, 22_050_664, True),
        ("vit_b16", 768, 86_567_656, False),
        ("vit_l16", 1024, 304_326_632, False),
    ):
        expected = published - width + width * width + width
        if s16:
            expected -= 196 * width + width
        assert _image_size(name) == 224  # the registry's trace is at 224 x 224
        assert _num(_real_size_trace(name)[0]["params"]) == expected, name


def test_inception_v3_keras_counts():
    shapes = _shapes(v3.InceptionV3(num_classes=1000, aux_logits=False), 299)
    assert _num(shapes["params"]) == 23_817_352  # trainable
    assert _num(shapes["params"]) + _num(shapes["batch_stats"]) == 23_851_784  # total


def test_inception_v3_default_count_derived_from_published():
    # Defaults (the original): 1001 classes, aux head, BN without a learned scale. From
    # torchvision's 27,161,264: one parameter less per BN channel (no gamma), and one more class
    # on the main logits (2048 inputs + bias) and on the aux logits (768 + bias) = 27,145,970.
    shapes = _shapes(v3.InceptionV3(), 299)
    bn_channels = _num(shapes["batch_stats"]) // 2  # a mean and a variance per BN channel
    assert bn_channels == 18_112  # = the BN weights counted in torchvision's inception_v3
    assert _num(shapes["params"]) == 27_161_264 - bn_channels + (2048 + 1) + (768 + 1)


def test_inception_v4_default_count_derived_from_published():
    # Defaults (the original): 1001 classes, aux head, BN without a learned scale. From timm's
    # 42,679,816 (no aux, BN scale): minus one gamma per BN channel outside the aux head, plus
    # one class (1536 inputs + bias), plus the aux head = 46,009,106.
    shapes = _shapes(v4.InceptionV4(), 299)
    aux = _num(shapes["params"]["AuxLogits"])
    # The aux head: 1x1 conv 1024->128 + beta, 5x5 conv 128->768 + beta, fc 768->1001 + bias.
    assert aux == 1024 * 128 + 128 + 5 * 5 * 128 * 768 + 768 + 768 * 1001 + 1001
    bn_channels_no_aux = _num(shapes["batch_stats"]) // 2 - (128 + 768)
    assert bn_channels_no_aux == 31_584  # = the BN weights counted in timm's inception_v4
    assert _num(shapes["params"]) == 42_679_816 - bn_channels_no_aux + (1536 + 1) + aux


def _resnet_formula(stage_sizes, bottleneck, filters, num_classes, always_project=True):
    """Parameter count of the original's ResNet written out from its architecture."""
    conv = lambda k, cin, cout: k * k * cin * cout  # noqa: E731  (no bias)
    bn = lambda c: 2 * c  # noqa: E731  (gamma, beta)
    n = conv(7, 3, filters) + bn(filters)
    cin = filters
    for g, blocks in enumerate(stage_sizes):
        f = filters * 2**g
        cout = 4 * f if bottleneck else f
        for b in range(blocks):
            if b == 0 and (always_project or cin != cout or g > 0):
                n += conv(1, cin, cout) + bn(cout)
            if bottleneck:
                n += conv(1, cin, f) + bn(f) + conv(3, f, f) + bn(f) + conv(1, f, cout) + bn(cout)
            else:
                n += conv(3, cin, f) + bn(f) + conv(3, f, f) + bn(f)
            cin = cout
    return n + cin * num_classes + num_classes


@pytest.mark.parametrize(
    "name,stages,bottleneck,filters",
    [
        ("resnet18", (2, 2, 2, 2), False, 64),
        ("resnet50", (3, 4, 6, 3), True, 64),
        ("resnet200", (3, 24, 36, 3), True, 64),
        ("resnet_tiny", (1, 1), False, 8),
        ("resnet_tiny_bottleneck", (1, 1), True, 8),
    ],
)
def test_resnet_count_matches_architecture_formula(name, stages, bottleneck, filters):
    # The formula reproduces the published counts (test above), so it vouches for the tiny ones.
    expected = _resnet_formula(stages, bottleneck, filters, 1000)
    assert _image_size(name) == 224  # the trace below is at 224 x 224
    assert _num(_real_size_trace(name)[0]["params"]) == expected
    if name == "resnet18":
        assert _resnet_formula(stages, False, 64, 1000, always_project=False) == 11_689_512


# --------------------------------------------------------------------------------------------
# Numerics: NaN, gradients, train vs eval. One compiled gradient + one compiled eval per model.
# --------------------------------------------------------------------------------------------
NUMERIC = {
    # name: (image size, path of the first conv module, path of the BN after it, BN decay,
    #        real initialisers?)
    "resnet_tiny": (32, ("initial_conv",), ("initial_bn",), 0.9, True),
    "resnet_tiny_bottleneck": (32, ("initial_conv",), ("initial_bn",), 0.9, True),
    "resnet18": (32, ("initial_conv",), ("initial_bn",), 0.9, False),
    "resnet50": (32, ("initial_conv",), ("initial_bn",), 0.9, False),
    "efficientnet_tiny": (32, ("conv_stem",), ("bn0",), 0.99, True),
    "inception_v3_tiny": (107, ("Conv2d_1a_3x3", "conv"), ("Conv2d_1a_3x3", "bn"), 0.996, False),
    "inception_v4_tiny": (
        107,
        ("stem", "Conv2d_1a_3x3", "conv"),
        ("stem", "Conv2d_1a_3x3", "bn"),
        0.995,
        False,
    ),
}
NUM_CLASSES = 10


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _split(out):
    return out if isinstance(out, tuple) else (out, None)


def _he_variables(model, rngs, x):
    """Variables of ``model`` with He-scaled random kernels, built from ``eval_shape`` + numpy.

    Compiling a model's ``init`` costs XLA:CPU 10-20 s for the ~200 truncated-normal
    initialisers of an Inception; the checks that use this need a realistic point, not the
    exact initialiser (which the tiny ResNets exercise with real ``init``).
    """
    shapes = jax.eval_shape(lambda: model.init(rngs, x, train=False))
    rng = np.random.default_rng(0)

    def fill(path, s):
        key = path[-1].key
        if key == "kernel":
            fan_in = int(np.prod(s.shape[:-1]))
            return jnp.asarray(rng.normal(0.0, np.sqrt(2.0 / fan_in), s.shape), s.dtype)
        if key in ("scale", "var"):
            return jnp.ones(s.shape, s.dtype)
        return jnp.zeros(s.shape, s.dtype)  # bias, mean

    return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.cache
def _numeric_run(name):
    """Initialises ``name`` and runs one train-mode gradient (two dropout rngs) and eval twice."""
    size, conv_path, _, _, real_init = NUMERIC[name]
    model = get_model(name, num_classes=NUM_CLASSES)
    x = jax.random.normal(jax.random.key(1), (2, size, size, 3))
    labels = jnp.array([3, 7])
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    if real_init:
        variables = _compile(lambda r, x: model.init(r, x, train=False), rngs, x)(rngs, x)
    else:
        variables = _he_variables(model, rngs, x)
    # The last BN of every ResNet block starts with gamma = 0 (as the original), which blocks
    # the gradient to that block's convs at initialisation by design; a trained network has
    # gamma != 0, so check gradient flow with all BN scales set to 1.
    grad_params = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.ones_like(v) if p[-1].key == "scale" else v, variables["params"]
    )
    capture = lambda mdl, _: mdl.scope.path == conv_path  # noqa: E731

    def loss_fn(p, batch_stats, x, dropout_rng):
        out, state = model.apply(
            {"params": p, "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
            rngs={"dropout": dropout_rng},
            capture_intermediates=capture,
        )
        logits, aux = _split(out)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        if aux is not None:  # the original weights the aux loss 0.4
            loss += 0.4 * optax.softmax_cross_entropy_with_integer_labels(aux, labels).mean()
        return loss, (out, state)

    grad_fn = _compile(
        jax.value_and_grad(loss_fn, has_aux=True),
        grad_params,
        variables["batch_stats"],
        x,
        jax.random.key(2),
    )
    train_a = grad_fn(grad_params, variables["batch_stats"], x, jax.random.key(2))
    train_b = grad_fn(grad_params, variables["batch_stats"], x, jax.random.key(3))

    eval_a, eval_b = _eval_twice(model, variables, x)
    (loss, (out_a, state_a)), grads = train_a
    (_, (out_b, _)), _ = train_b
    return types.SimpleNamespace(
        model=model,
        x=x,
        variables=variables,
        grad_params=grad_params,
        loss=loss,
        grads=grads,
        out_a=out_a,
        state_a=state_a,
        out_b=out_b,
        eval_a=eval_a,
        eval_b=eval_b,
    )


def _eval_twice(model, variables, x):
    """Eval-mode outputs and state of ``model`` with two different dropout rngs."""

    def eval_fn(v, x, dropout_rng):
        return model.apply(
            v, x, train=False, mutable=["batch_stats"], rngs={"dropout": dropout_rng}
        )

    ev = _compile(eval_fn, variables, x, jax.random.key(2))
    return ev(variables, x, jax.random.key(2)), ev(variables, x, jax.random.key(3))


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_output_shape_dtype_and_no_nan(name):
    r = _numeric_run(name)
    out, eval_out = r.out_a, r.eval_a[0]
    assert np.isfinite(float(r.loss))
    for mode_out in (out, eval_out):
        logits, aux = _split(mode_out)
        assert logits.shape == (2, NUM_CLASSES) and logits.dtype == jnp.float32
        assert np.all(np.isfinite(logits))
        if name.startswith("inception"):  # the aux head's logits come back too
            assert aux.shape == (2, NUM_CLASSES) and np.all(np.isfinite(aux))


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_every_parameter_receives_a_nonzero_gradient(name):
    flat = jax.tree_util.tree_flatten_with_path(_numeric_run(name).grads)[0]
    dead = [jax.tree_util.keystr(p) for p, g in flat if not np.any(np.asarray(g) != 0)]
    assert not dead, f"parameters with an all-zero gradient: {dead}"
    assert all(np.all(np.isfinite(g)) for _, g in flat)


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_train_mode_updates_batch_stats_with_the_original_decay(name):
    r = _numeric_run(name)
    variables, state = r.variables, r.state_a
    _, conv_path, bn_path, decay, _ = NUMERIC[name]
    conv_out = _get(state["intermediates"], conv_path)["__call__"][0]
    batch_mean = np.asarray(conv_out).mean(axis=(0, 1, 2))
    batch_var = np.asarray(conv_out).var(axis=(0, 1, 2))
    old = _get(variables["batch_stats"], bn_path)
    new = _get(state["batch_stats"], bn_path)
    # TF/flax moving average: new = decay * old + (1 - decay) * batch statistic.
    np.testing.assert_allclose(
        new["mean"], decay * old["mean"] + (1 - decay) * batch_mean, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(
        new["var"], decay * old["var"] + (1 - decay) * batch_var, rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_eval_mode_is_deterministic_and_leaves_batch_stats_alone(name):
    r = _numeric_run(name)
    variables, (out_a, state_a), (out_b, _) = r.variables, r.eval_a, r.eval_b
    for a, b in zip(
        _split(out_a), _split(out_b), strict=False
    ):  # different dropout rngs, same outputs
        if a is not None:
            np.testing.assert_array_equal(a, b)
    jax.tree.map(np.testing.assert_array_equal, state_a["batch_stats"], variables["batch_stats"])


@pytest.mark.parametrize("name", sorted(NUMERIC))
def test_dropout_only_in_train_and_only_before_the_main_logits(name):
    r = _numeric_run(name)
    out_a, out_b, eval_out = r.out_a, r.out_b, r.eval_a[0]
    logits_a, aux_a = _split(out_a)
    logits_b, aux_b = _split(out_b)
    if name.startswith("inception"):
        # slim's Dropout_1b (keep 0.8) sits before the logits only: a different dropout rng
        # changes the logits, not the aux head.
        assert not np.allclose(logits_a, logits_b)
        np.testing.assert_array_equal(aux_a, aux_b)
    elif name.startswith("efficientnet"):  # dropout before the head, drop-connect in blocks
        assert not np.allclose(logits_a, logits_b)
    else:  # ResNet has no dropout: train mode is deterministic given the batch
        np.testing.assert_array_equal(logits_a, logits_b)
    # Train (batch statistics) and eval (moving averages) do differ.
    assert not np.allclose(logits_a, _split(eval_out)[0])


def test_resnet_last_bn_of_every_block_starts_at_zero_gamma():
    params = _numeric_run("resnet_tiny_bottleneck").variables["params"]
    blocks = [params[g][b] for g in params if g.startswith("block_group") for b in params[g]]
    assert len(blocks) == 2
    for block in blocks:
        np.testing.assert_array_equal(block["bn3"]["scale"], 0.0)
        for bn in ("bn1", "bn2", "proj_bn"):
            np.testing.assert_array_equal(block[bn]["scale"], 1.0)
    basic = _numeric_run("resnet_tiny").variables["params"]
    for g in ("block_group1", "block_group2"):
        np.testing.assert_array_equal(basic[g]["block0"]["bn2"]["scale"], 0.0)
    # Dense head N(0, 0.01) (the original's random_normal_initializer(stddev=.01)).
    w = _numeric_run("resnet_tiny_bottleneck").variables["params"]["final_dense"]["kernel"]
    w = np.asarray(w)
    # 640 draws: the sample std is within 3% of 0.01 with overwhelming probability.
    assert w.shape == (64, NUM_CLASSES) and 0.0085 < w.std() < 0.0115


def test_resnet_strided_convs_use_the_originals_fixed_padding():
    # conv2d_fixed_padding pads (k-1)//2 before and the rest after, whatever the input size;
    # 'SAME' would pad (2, 3) for a 7x7/2 conv on an even input.
    r = _numeric_run("resnet_tiny")
    got = r.state_a["intermediates"]["initial_conv"]["__call__"][0]
    kernel = r.grad_params["initial_conv"]["kernel"]
    want = jax.lax.conv_general_dilated(
        r.x, kernel, (2, 2), ((3, 3), (3, 3)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,size", [("resnet_tiny", 32), ("inception_v4_tiny", 107)])
def test_conv_and_max_pool_are_injectable_everywhere(name, size):
    conv_calls, pool_calls = [], []

    def spy_conv(*args, **kwargs):
        conv_calls.append(1)
        return jax.lax.conv_general_dilated(*args, **kwargs)

    def spy_pool(*args, **kwargs):
        pool_calls.append(1)
        return nn.max_pool(*args, **kwargs)

    model = get_model(
        name, conv=functools.partial(nn.Conv, conv_general_dilated=spy_conv), max_pool=spy_pool
    )
    shapes = _shapes(model, size)  # tracing init runs every conv and pool once
    kernels = [
        p
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes["params"])[0]
        if p[-1].key == "kernel"
        and p[-2].key != "final_dense"
        and p[-2].key not in ("Logits", "Aux_logits")
    ]
    assert len(conv_calls) == len(kernels)
    assert len(pool_calls) == (1 if name.startswith("resnet") else 4)  # v4: 3a, 5a, 6a, 7a


def test_bfloat16_compute_keeps_float32_params_and_logits():
    r = _numeric_run("resnet_tiny")
    model = resnet.ResNetTiny(num_classes=NUM_CLASSES, dtype=jnp.bfloat16)
    fwd = lambda v, x: model.apply(v, x, train=False)  # noqa: E731
    logits = _compile(fwd, r.variables, r.x)(r.variables, r.x)
    ref = r.eval_a[0]
    assert {v.dtype for v in jax.tree.leaves(r.variables["params"])} == {jnp.dtype(jnp.float32)}
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, ref, rtol=0.05, atol=0.05)
    assert not np.array_equal(logits, ref)  # it really computed in bfloat16


def test_registry_and_errors_name_the_bad_value():
    assert set(MODELS) >= {
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnet200",
        "inception_v3",
        "inception_v4",
    }
    with pytest.raises(ValueError, match="'resnet51'.*resnet50"):
        get_model("resnet51")
    with pytest.raises(ValueError, match="--resnet_depth=51"):
        resnet_v1(51)
    with pytest.raises(ValueError, match="at least 107x107.*got 99x99"):
        _shapes(v3.InceptionV3Tiny(), 99)
    assert (
        isinstance(resnet_v1(50), resnet.ResNet)
        and resnet_v1(50).block_cls is resnet.BottleneckBlock
    )


@pytest.mark.parametrize("name", ["inception_v3_tiny", "inception_v4_tiny", "resnet50"])
def test_bfloat16_traces_for_every_family(name):
    size = NUMERIC[name][0]
    model = get_model(name, num_classes=NUM_CLASSES, dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}

    def train_step_shapes(x):
        variables = model.init(rngs, x, train=False)
        return model.apply(variables, x, train=True, mutable=["batch_stats"], rngs=rngs)

    out, state = jax.eval_shape(train_step_shapes, x)
    for logits in out if isinstance(out, tuple) else (out,):
        assert logits.shape == (2, NUM_CLASSES) and logits.dtype == jnp.float32
    assert {v.dtype for v in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32)}


# --------------------------------------------------------------------------------------------
# EfficientNet: what the parameter counts do not see (block layout, skips, drop-connect, inits).
# Expected values are the original's formulas (efficientnet_model.round_filters/round_repeats)
# worked by hand, and timm's published head widths (num_features) of tf_efficientnet_b2..b7.
# --------------------------------------------------------------------------------------------
def test_efficientnet_block_strings_decode_as_the_original():
    args = efficientnet.decode_block_string("r2_k5_s22_e6_i24_o40_se0.25")
    assert (args.num_repeat, args.kernel_size, args.strides, args.expand_ratio) == (2, 5, (2, 2), 6)
    assert (args.input_filters, args.output_filters, args.se_ratio, args.id_skip) == (
        24,
        40,
        0.25,
        True,
    )
    bare = efficientnet.decode_block_string("r1_k3_s11_e1_i32_o16_noskip")
    assert bare.se_ratio is None and bare.id_skip is False
    with pytest.raises(ValueError, match="strides"):
        efficientnet.decode_block_string("r1_k3_s1_e1_i32_o16")


@pytest.mark.parametrize(
    "width,depth,head,blocks",
    [
        (1.0, 1.0, 1280, 16),
        (1.1, 1.2, 1408, 23),  # b2: 2+3+3+4+4+5+2 repeats
        (1.2, 1.4, 1536, 26),  # b3
        (1.4, 1.8, 1792, 32),  # b4
        (2.0, 3.1, 2560, 55),  # b7: ceil(3.1 * (1, 2, 2, 3, 3, 4, 1))
    ],
)
def test_efficientnet_round_filters_and_repeats(width, depth, head, blocks):
    assert efficientnet.round_filters(1280, width) == head
    layout = efficientnet.scaled_blocks(efficientnet.BLOCKS_ARGS, width, depth)
    assert len(layout) == blocks
    # The first block of a stage strides and changes width; its repeats do neither.
    for prev, block in zip(layout, layout[1:], strict=False):
        if block.strides != (1, 1) or block.input_filters != block.output_filters:
            assert block.input_filters == prev.output_filters
    # Never more than 10% below the scaled count: 40 * 0.25 = 10 rounds to 8, then back up to 16.
    assert efficientnet.round_filters(40, 0.25) == 16
    assert efficientnet.round_filters(16, 0.25) == 8  # at least the divisor


def test_efficientnet_skip_only_where_strides_are_1_and_widths_match():
    r = _numeric_run("efficientnet_tiny")
    params = jax.tree.map(lambda v: v, r.variables["params"])
    # Zeroing a block's last batch norm zeroes its branch: what is left is the skip.
    for name in ("blocks_1", "blocks_2"):
        params[name]["bn2"] = jax.tree.map(jnp.zeros_like, params[name]["bn2"])
    capture = lambda mdl, _: mdl.scope.path in (("blocks_1",), ("blocks_2",))  # noqa: E731
    _, state = r.model.apply(
        {**r.variables, "params": params},
        r.x,
        train=False,
        mutable=["intermediates"],
        capture_intermediates=capture,
    )
    out = state["intermediates"]
    # blocks_1 (stride 2, 8 -> 8 at 32 px) has no skip; blocks_2 (its repeat) has one.
    np.testing.assert_array_equal(out["blocks_1"]["__call__"][0], 0.0)
    np.testing.assert_array_equal(out["blocks_2"]["__call__"][0], out["blocks_1"]["__call__"][0])


def test_efficientnet_drop_connect_keeps_whole_examples_scaled():
    x = jnp.ones((4000, 2, 2, 3))
    layer = efficientnet.DropConnect(0.25)
    y = np.asarray(layer.apply({}, x, False, rngs={"dropout": jax.random.key(0)}))
    per_example = y.reshape(len(y), -1)
    kept = per_example[:, 0] != 0
    # Each example is all dropped or all kept and scaled by 1 / (1 - rate).
    np.testing.assert_array_equal(per_example[kept], np.float32(1 / 0.75))
    np.testing.assert_array_equal(per_example[~kept], 0.0)
    assert 0.72 < kept.mean() < 0.78  # 4000 draws of p = 0.75
    np.testing.assert_array_equal(layer.apply({}, x, True), x)  # eval: the identity


def test_efficientnet_initialisers_are_the_originals():
    params = _numeric_run("efficientnet_tiny").variables["params"]
    # conv_kernel_initializer: N(0, sqrt(2 / (kh * kw * out))), untruncated.
    head = np.asarray(params["conv_head"]["kernel"])  # [1, 1, 16, 320]
    np.testing.assert_allclose(head.std(), np.sqrt(2 / 320), rtol=0.05)
    assert np.abs(head).max() > 2.2 * np.sqrt(2 / 320)  # no truncation at 2 sigma
    # The depthwise kernel's TF fan_out is kh * kw (depth multiplier 1).
    dw = np.asarray(params["blocks_1"]["depthwise_conv"]["kernel"])  # [3, 3, 1, 48]
    assert dw.shape == (3, 3, 1, 48)
    np.testing.assert_allclose(dw.std(), np.sqrt(2 / 9), rtol=0.1)
    # dense_kernel_initializer: U(-1/sqrt(classes), 1/sqrt(classes)); biases start at 0.
    fc = np.asarray(params["fc"]["kernel"])
    bound = 1 / np.sqrt(NUM_CLASSES)
    assert np.abs(fc).max() <= bound and np.abs(fc).max() > 0.9 * bound
    np.testing.assert_array_equal(params["fc"]["bias"], 0.0)
    np.testing.assert_array_equal(params["blocks_1"]["se"]["reduce_conv"]["bias"], 0.0)
