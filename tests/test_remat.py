"""``--remat`` (``estimax.parallel.remat.remat_block``): per-block rematerialisation.

What must hold: the default ("none") is the plain model (the same class, so the same parameter
tree and values); any policy keeps every parameter path (checkpoints and the TensorFlow name
maps follow them) and gives the plain model's loss, gradients and batch statistics, to fp32
rounding (rtol 1e-5, atol 1e-6; ResNet's and EfficientNet's came out bit-equal on XLA:CPU);
``--remat=full`` recomputes the blocks in the compiled train step; a bad name is one line
naming the flag.
Compute is kept small: the tiny variants at batch 2, compiled at XLA's level 0 as in
test_models.py (the same values, compiled several times faster on 2 shared cores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from estimax import ops
from estimax.models import MODELS, efficientnet, vit
from estimax.models.resnet import ResidualBlock, ResNet
from estimax.parallel import remat as remat_lib
from estimax.programs import efficientnet as efficientnet_program
from estimax.programs import families, inception_v3
from estimax.programs import resnet as resnet_program
from estimax.programs import vit as vit_program

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# model name -> image side (the Inceptions' tiny variants still need 107 px for their aux head).
SIZES = {
    "resnet_tiny": 32,
    "resnet_tiny_bottleneck": 32,
    "efficientnet_tiny": efficientnet.TINY_RESOLUTION,
    "vit_tiny": vit.TINY_RESOLUTION,
    "inception_v3_tiny": 107,
    "inception_v4_tiny": 107,
}
RNGS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


def _shapes(name: str, remat: str):
    """Variable shapes of ``name`` under ``remat``, without computing."""
    model = MODELS[name](num_classes=5, remat=remat)
    x = jnp.zeros((1, SIZES[name], SIZES[name], 3))
    return jax.eval_shape(lambda: model.init(RNGS, x, train=False))


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_policy_keeps_the_parameter_paths_and_shapes(name):
    plain = _shapes(name, "none")
    for policy in ("full", "dots_saveable"):
        assert jax.tree_util.tree_flatten_with_path(_shapes(name, policy)) == (
            jax.tree_util.tree_flatten_with_path(plain)
        ), policy


def test_the_default_is_the_plain_block_class():
    # "none" hands back the class itself: the default model is the one before --remat existed.
    assert remat_lib.remat_block(ResidualBlock, "none") is ResidualBlock
    assert ResNet.remat == "none" and vit.ViT.remat == "none"
    assert remat_lib.remat_block(ResidualBlock, "full") is not ResidualBlock


def _train_step(name: str, remat: str, **model_kw):
    """(variables, loss, grads, new batch_stats) of one train-mode step of ``name``."""
    model = MODELS[name](num_classes=5, remat=remat, **model_kw)
    size = SIZES[name]
    x = jnp.asarray(np.random.RandomState(0).randn(2, size, size, 3), jnp.float32)
    variables = jax.jit(lambda: model.init(RNGS, x, train=False)).lower().compile(FAST_COMPILE)()

    def loss_fn(params, rng):
        out, state = model.apply(
            {**variables, "params": params},
            x,
            train=True,
            mutable=["batch_stats"],
            rngs={"dropout": rng},
        )
        logits = out[0] + 0.4 * out[1] if isinstance(out, tuple) else out
        return jnp.mean(jax.nn.log_softmax(logits)[:, 1]) + jnp.mean(logits**2), state

    step = jax.value_and_grad(loss_fn, has_aux=True)
    args = (variables["params"], jax.random.key(2))
    (loss, state), grads = jax.jit(step).lower(*args).compile(FAST_COMPILE)(*args)
    return variables, loss, grads, state.get("batch_stats", {})


@pytest.mark.parametrize(
    "name,policy,model_kw",
    [
        ("resnet_tiny", "full", {}),
        # Drop-connect draws from the dropout stream inside the rematerialised block.
        ("efficientnet_tiny", "full", {"drop_connect_rate": 0.5}),
        ("vit_tiny", "dots_with_no_batch_dims_saveable", {"dropout": 0.1}),
        # The Inceptions (the same remat_block; their paths are checked above) and ResNet's
        # bottleneck under dots_saveable also matched (atol 1e-6) but take minutes on 2 loaded
        # cores: inception_v4_tiny 320 s.
    ],
)
def test_values_gradients_and_batch_stats_equal_the_plain_models(name, policy, model_kw):
    plain = _train_step(name, "none", **model_kw)
    remat = _train_step(name, policy, **model_kw)
    for a, b in zip(
        jax.tree.leaves(plain[0]), jax.tree.leaves(remat[0]), strict=True
    ):  # the same init
        np.testing.assert_array_equal(a, b)
    for got, want in zip(remat[1:], plain[1:], strict=True):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_compiled_train_step_recomputes_the_blocks_under_remat_full():
    # What --compile_for compiles and reads memory_analysis() from: a train step with a ResNet
    # of two groups of two basic blocks (XLA's convolutions: standard layers), 64x64, batch 8,
    # XLA:CPU's HLO passes (LLVM at level 0, FAST_COMPILE: it only generates the machine code,
    # after the HLO passes have decided what runs). The recomputation survives XLA's simplifier
    # (jax.checkpoint's optimization barrier): the compiled step has more convolutions.
    # XLA:CPU's scheduler runs it early, though, so on a CPU the temporaries do not fall
    # (measured 2026-12, jax 0.10.2, default compiler:
    # 5,292,288 -> 5,489,664 bytes here; 23.1 -> 23.6 MB at 128x128); TPU's and GPU's
    # memory-aware schedulers place it in the backward pass, where it saves memory.
    model_kw = {"stage_sizes": (2, 2), "block_cls": ResidualBlock, "num_filters": 16}
    x = jnp.zeros((8, 64, 64, 3))
    convolutions, temps = {}, {}
    for policy in ("none", "full"):
        model = ResNet(num_classes=10, remat=policy, **model_kw, **ops.standard_layers())
        variables = jax.eval_shape(lambda m=model: m.init(RNGS, x, train=False))

        def loss_fn(params, batch_stats, m=model):
            logits, state = m.apply(
                {"params": params, "batch_stats": batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            return jnp.mean(logits**2), state

        step = jax.value_and_grad(loss_fn, has_aux=True)
        lowered = jax.jit(step).lower(variables["params"], variables["batch_stats"])
        compiled = lowered.compile(FAST_COMPILE)
        convolutions[policy] = compiled.as_text().count(" convolution(")
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
    # 9 block convolutions run again; the forward's own (stem, blocks) and the backward's stay.
    assert convolutions["full"] > convolutions["none"], (convolutions, temps)
    assert temps["none"] > 0 and temps["full"] > 0


def test_an_unknown_policy_is_one_line_naming_the_flag_and_the_choices():
    with pytest.raises(ValueError) as e:
        remat_lib.remat_block(ResidualBlock, "dots")
    message = str(e.value)
    assert "\n" not in message and "--remat='dots'" in message
    assert all(name in message for name in remat_lib.REMAT_CHOICES)
    with pytest.raises(flags.Error) as e:
        resnet_program.FAMILY.parse(["--remat=dots"])
    assert "--remat" in str(e.value) and "dots_with_no_batch_dims_saveable" in str(e.value)


# program -> its network from the recipe the flags make.
BUILDERS = {
    "resnet": resnet_program.build_model,
    "efficientnet": efficientnet_program.build_model,
    "inception_v3": inception_v3.build_model,
    "inception_v4": inception_v3.build_model,
    "vit": vit_program.build_model,
}


@pytest.mark.parametrize("program", sorted(BUILDERS))
def test_every_image_program_hands_the_flag_to_its_model(program):
    family = families.get(program)
    assert family.parse([]).remat == "none"
    fv = family.parse(["--remat=checkpoint_dots"])
    model = BUILDERS[program](family.config_from_flags(fv))
    assert model.remat == "checkpoint_dots"
    # Not a model-shaping flag: a model_dir may resume under another policy.
    assert "remat" not in family.model_flags


def test_every_image_family_is_covered():
    # MNIST's two-conv network has no blocks to rematerialise and takes no --remat.
    assert set(families.FAMILIES) - set(BUILDERS) == {"mnist"}
