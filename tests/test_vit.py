"""The ``vit`` family: big_vision's ViT and ImageNet recipe, its flags, and a tiny run.

Expected values come from google-research/big_vision: ``big_vision/models/vit.py``
(``decode_variant``, ``posemb_sincos_2d``, the module tree), ``big_vision/configs/
vit_s16_i1k.py`` (the recipe's values), ``big_vision/optax.py`` (the update: clip, Adam, ``* lr``,
``+ wd * kernel``, ``* schedule``) and ``big_vision/utils.py`` (``create_learning_rate_schedule``,
``sigmoid_xent``). Parameter counts against published numbers are in test_models.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_programs import _spec

from estimax.data import augment
from estimax.models import get_model
from estimax.models import vit as vit_model
from estimax.programs import cli, common, families, vit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("ESTIMAX_", "TPU_"))},
    "PYTHONPATH": REPO,
    # One device; LLVM at level 0 (FAST_COMPILE below): a program run compiles its train, eval
    # and predict steps, and most of its time went to LLVM.
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
}
TINY = vit.ViTConfig(model_name="vit-tiny", num_label_classes=10, train_steps=100, warmup_steps=10)


# XLA's level 0 (as tests/test_models.py): the same values, compiled several times faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _fast(fn, *args):
    """``fn`` jitted and compiled for ``args`` at XLA's level 0."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def parse(argv: list[str]):
    return vit.FAMILY.parse(argv)


def _estimax(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "estimax", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
        cwd=REPO,
    )


# --------------------------------------------------------------------------- the network


def test_variants_are_big_visions():
    # decode_variant: S 384/12/1536/6, B 768/12/3072/12, L 1024/24/4096/16, 16x16 patches.
    dims = {
        name: (m.keywords["width"], m.keywords["depth"], m.keywords["mlp_dim"])
        + (m.keywords["num_heads"], m.keywords["patch_size"])
        for name, (m, size) in vit_model.VIT_VARIANTS.items()
        if size == 224
    }
    assert dims == {
        "vit-s16": (384, 12, 1536, 6, 16),
        "vit-b16": (768, 12, 3072, 12, 16),
        "vit-l16": (1024, 24, 4096, 16, 16),
    }
    # The heads of the configs: vit_s16_i1k.py (gap, sincos2d, rep) and vit_i1k.py (tok, learn).
    s16 = vit_model.VIT_VARIANTS["vit-s16"][0].keywords
    b16 = vit_model.VIT_VARIANTS["vit-b16"][0].keywords
    assert (s16["pool_type"], s16["posemb"], s16["rep_size"]) == ("gap", "sincos2d", True)
    assert (b16["pool_type"], b16["posemb"], b16["rep_size"]) == ("tok", "learn", True)


def test_sincos_posemb_is_the_moco_v3_table():
    pe = np.asarray(vit_model.posemb_sincos_2d(2, 3, 8))
    assert pe.shape == (1, 6, 8)
    omega = 1.0 / 10_000.0 ** (np.arange(2) / 1)
    y, x = np.mgrid[:2, :3]
    want = np.concatenate(
        [
            np.sin(np.outer(x.ravel(), omega)),
            np.cos(np.outer(x.ravel(), omega)),
            np.sin(np.outer(y.ravel(), omega)),
            np.cos(np.outer(y.ravel(), omega)),
        ],
        axis=1,
    )
    np.testing.assert_allclose(pe[0], want, rtol=1e-6, atol=1e-6)


def _init_shapes(model, size=32):
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    return jax.eval_shape(lambda x: model.init(jax.random.key(1), x), x)["params"]


def test_tiny_tree_names_shapes_and_zero_head():
    model = get_model("vit_tiny", num_classes=10)
    params = _init_shapes(model)
    # big_vision's names: embedding, Transformer/encoderblock_i, encoder_norm, pre_logits, head.
    assert sorted(params) == ["Transformer", "embedding", "head", "pre_logits"]
    assert sorted(params["Transformer"]) == ["encoder_norm", "encoderblock_0", "encoderblock_1"]
    assert params["embedding"]["kernel"].shape == (8, 8, 3, 32)
    assert "pos_embedding" not in params  # sincos2d: no parameters
    tok = get_model("vit_tiny", num_classes=10, pool_type="tok", posemb="learn", rep_size=False)
    tparams = _init_shapes(tok)
    assert tparams["cls"].shape == (1, 1, 32) and tparams["pos_embedding"].shape == (1, 16, 32)
    assert "pre_logits" not in tparams
    with pytest.raises(ValueError, match="divisible by 8, got 30x30"):
        _init_shapes(model, 30)
    # One compiled init + apply: float32 logits, all zero from the zero-initialised head, also
    # when computing in bfloat16.
    bf16 = get_model("vit_tiny", num_classes=10, dtype=jnp.bfloat16)

    def logits(x):
        variables = model.init(jax.random.key(1), x)
        return model.apply(variables, x), bf16.apply(variables, x)

    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
    f32, b16 = _fast(logits, x)(x)
    assert f32.shape == (2, 10) and f32.dtype == jnp.float32 and b16.dtype == jnp.float32
    assert not np.asarray(f32).any()


def test_dropout_only_in_training():
    model = get_model("vit_tiny", num_classes=10, dropout=0.5, head_zeroinit=False)
    x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))

    def outputs(x):
        variables = model.init(jax.random.key(1), x)
        run = lambda train, k: model.apply(  # noqa: E731
            variables, x, train=train, rngs={"dropout": jax.random.key(k)}
        )
        return run(False, 1), run(False, 2), run(True, 1), run(True, 2)

    eval_a, eval_b, train_a, train_b = _fast(outputs, x)(x)
    np.testing.assert_array_equal(eval_a, eval_b)
    assert not np.allclose(train_a, train_b)


# --------------------------------------------------------------------------- the recipe


def test_flag_defaults_are_big_visions_s16_recipe():
    fv = parse([])
    cfg = vit.config_from_flags(fv)
    # vit_s16_i1k.py: batch 1024, 90 epochs, lr 0.001, wd 0.0001, warmup 10k, cosine,
    # scale_by_adam(mu_dtype=bfloat16), grad_clip_norm 1.0, softmax_xent, randaug(2,10), mixup 0.2.
    assert (cfg.model_name, cfg.train_batch_size, cfg.train_steps) == ("vit-s16", 1024, 112603)
    assert cfg.train_steps == -(-90 * 1_281_167 // 1024)
    assert (cfg.base_learning_rate, cfg.weight_decay, cfg.warmup_steps) == (0.001, 0.0001, 10000)
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon) == (0.9, 0.999, 1e-8)
    assert (cfg.mu_dtype, cfg.grad_clip_norm, cfg.loss, cfg.label_smoothing) == (
        "bfloat16",
        1.0,
        "softmax",
        0.0,
    )
    assert vit.augmentation(fv) == augment.RandAugment(2, 10.0)
    assert fv.mixup_alpha == 0.2 and fv.data_dir == "fake"
    assert vit.image_size(fv) == 224 and vit.image_size(parse(["--model_name=vit-tiny"])) == 32


def test_flags_reach_the_recipe_and_the_network():
    fv = parse(
        [
            "--model_name=vit-b16",
            "--loss=sigmoid",
            "--label_smoothing=0.1",
            "--adam_beta2=0.95",
            "--mu_dtype=float32",
            "--warmup_steps=5",
            "--weight_decay=0.03",
            "--pool_type=gap",
            "--posemb=sincos2d",
            "--representation_size=0",
            "--dropout_rate=0.1",
            "--precision=bfloat16",
            "--augment=none",
        ]
    )
    cfg = vit.config_from_flags(fv)
    assert (cfg.loss, cfg.label_smoothing, cfg.adam_beta2, cfg.mu_dtype) == (
        "sigmoid",
        0.1,
        0.95,
        "float32",
    )
    assert (cfg.warmup_steps, cfg.weight_decay) == (5, 0.03)
    model = vit.build_model(cfg)
    assert (model.width, model.pool_type, model.posemb, model.rep_size) == (
        768,
        "gap",
        "sincos2d",
        0,
    )
    assert model.dropout == 0.1 and model.dtype == jnp.bfloat16
    assert vit.augmentation(fv) is None
    assert vit.augmentation(
        parse(["--randaug_num_layers=3", "--randaug_magnitude=7"])
    ) == augment.RandAugment(3, 7.0)
    assert vit.FAMILY.recorded_flags(fv) == {
        "model_name": "vit-b16",
        "num_label_classes": 1000,
        "input_image_size": None,
        "pool_type": "gap",
        "posemb": "sincos2d",
        "representation_size": 0,
    }
    assert families.get("vit") is vit.FAMILY
    features = vit.FAMILY.example_features(parse(["--model_name=vit-tiny"]))
    assert features.shape == (1, 32, 32, 3) and features.dtype == np.uint8
    with pytest.raises(cli.UsageError, match="--pool_type='cls': must be one of gap, tok"):
        vit.config_from_flags(parse(["--pool_type=cls"]))
    with pytest.raises(cli.UsageError, match="--input_image_size=100: vit-s16's 16x16 patches"):
        vit.config_from_flags(parse(["--input_image_size=100"]))


def test_schedule_is_big_visions_warmup_then_cosine():
    sched = vit.warmup_cosine(total_steps=110, warmup_steps=10)
    values = [float(sched(s)) for s in (0, 5, 10, 60, 110, 200)]
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 0.5, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(float(sched(35)), 0.5 * (1 + np.cos(np.pi * 0.25)), rtol=1e-6)


def test_optimizer_is_big_visions_update():
    cfg = dataclasses.replace(TINY, warmup_steps=0, train_steps=10, grad_clip_norm=0.0)
    params = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 2.0)}}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    tx = vit.make_optimizer(cfg, vit.warmup_cosine(cfg.train_steps, cfg.warmup_steps))
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    # Step 0: schedule 1; Adam's first step is g / (|g| + eps) ~ 1 per element.
    adam = 0.5 / (0.5 + 1e-8)
    np.testing.assert_allclose(updates["dense"]["bias"], -cfg.base_learning_rate * adam, rtol=1e-5)
    np.testing.assert_allclose(
        updates["dense"]["kernel"],
        -(cfg.base_learning_rate * adam + cfg.weight_decay * 2.0),  # decoupled, kernels only
        rtol=1e-5,
    )
    mu = [
        s.mu for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")
    ]
    assert {leaf.dtype for leaf in jax.tree.leaves(mu)} == {jnp.dtype(jnp.bfloat16)}
    # Clipping at global norm 1 scales these gradients (norm 0.5 * sqrt(6)) down first.
    clipped = vit.make_optimizer(
        dataclasses.replace(cfg, grad_clip_norm=1.0, weight_decay=0.0), lambda s: 1.0
    )
    big = jax.tree.map(lambda p: jnp.full_like(p, 10.0), params)
    u, _ = jax.jit(clipped.update)(big, clipped.init(params), params)
    np.testing.assert_allclose(u["dense"]["bias"], -cfg.base_learning_rate, rtol=1e-5)


def test_losses_are_big_visions_on_labels_and_mixed_targets():
    logits = jnp.array([[2.0, -1.0, 0.5], [0.1, 0.2, -0.3]])
    labels = jnp.array([0, 2])
    onehot = jax.nn.one_hot(labels, 3)
    softmax = vit.loss_fn(TINY, logits, labels)
    np.testing.assert_allclose(
        softmax, -jnp.sum(jax.nn.log_softmax(logits) * onehot, -1), rtol=1e-6
    )
    np.testing.assert_allclose(vit.loss_fn(TINY, logits, onehot), softmax, rtol=1e-6)
    sig = vit.loss_fn(dataclasses.replace(TINY, loss="sigmoid"), logits, labels)
    want = -jnp.sum(
        onehot * jax.nn.log_sigmoid(logits) + (1 - onehot) * jax.nn.log_sigmoid(-logits), -1
    )
    np.testing.assert_allclose(sig, want, rtol=1e-5)
    mixed = 0.7 * onehot + 0.3 * jnp.roll(onehot, 1, axis=0)
    smooth = vit.loss_fn(dataclasses.replace(TINY, label_smoothing=0.3), logits, mixed)
    target = optax.smooth_labels(mixed, 0.3)
    np.testing.assert_allclose(smooth, -jnp.sum(jax.nn.log_softmax(logits) * target, -1), rtol=1e-6)


def test_model_fn_scales_to_unit_range_and_takes_mixed_labels():
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.uint8)
    spec, loss, scalars = _spec(
        vit.make_model_fn(TINY),
        images,
        jnp.array([1, 2]),
        mode="eval",
        compiler_options=FAST_COMPILE,
    )
    assert loss.shape == (2,) and sorted(spec.eval_metrics) == ["top_1_accuracy", "top_5_accuracy"]
    # The zero head: uniform logits, loss log(10), whatever the images.
    np.testing.assert_allclose(loss, np.log(10.0), rtol=1e-5)
    targets = (
        np.eye(10, dtype=np.float32)[[1, 2]] * 0.6 + np.eye(10, dtype=np.float32)[[2, 1]] * 0.4
    )
    spec, loss, scalars = _spec(
        vit.make_model_fn(TINY), images.astype(np.float32), targets, compute=False
    )
    assert loss.shape == (2,) and spec.eval_metrics is None
    assert sorted(scalars) == ["current_epoch", "learning_rate"]
    np.testing.assert_allclose(
        np.asarray(vit.to_unit_range(np.array([0, 127.5, 255]), jnp.float32)), [-1, 0, 1]
    )


def test_tiny_vit_learns_a_fixed_batch_with_the_recipe():
    # The recipe's optimizer (warm-up 2, cosine over 30 steps, lr 3e-3) on 8 fixed images with
    # mixed targets: the loss falls well below its start (log 10).
    cfg = dataclasses.replace(TINY, base_learning_rate=3e-3, warmup_steps=2, train_steps=30)
    model = vit.build_model(cfg)
    rng = np.random.default_rng(0)
    images, labels = augment.mixup(
        rng.integers(0, 256, (8, 32, 32, 3)).astype(np.uint8), rng.integers(0, 10, 8), 0.8, 10
    )
    x = vit.to_unit_range(images, jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    tx = vit.make_optimizer(cfg, vit.warmup_cosine(cfg.train_steps, cfg.warmup_steps))

    def step(params, state):
        loss, grads = jax.value_and_grad(
            lambda p: vit.loss_fn(cfg, model.apply({"params": p}, x, train=True), labels).mean()
        )(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = tx.init(params)
    step = _fast(step, params, state)
    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(10.0), rel=1e-4)
    assert losses[-1] < 0.8 * losses[0], losses  # (mixed targets: their entropy ~0.5 is the floor)


# --------------------------------------------------------------------------- the command line


def test_without_data_dir_the_family_takes_random_images_and_says_so(tmp_path, monkeypatch, caplog):
    # No --data_dir: random images, said loudly at start and kept for TensorBoard's run
    # description. The job is built as the command line builds it and not run: the training
    # itself runs on real images below (one program run for both).
    jobs: list[common.Job] = []
    monkeypatch.setattr(common, "run", jobs.append)
    with caplog.at_level("WARNING"):
        vit.run_from_flags(parse(["--model_name=vit-tiny", f"--model_dir={tmp_path / 'm'}"]))
    [job] = jobs
    assert "FAKE DATA" in caplog.text and any("FAKE DATA" in note for note in job.notes)
    assert job.check_inputs is None or job.check_inputs() is None  # fake data has no images


def test_a_bad_flag_is_one_line(tmp_path):
    proc = _estimax("train", "--family=vit", "--model_name=vit-h14", f"--model_dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        "FATAL: --model_name='vit-h14' is not a ViT: use one of vit-s16, vit-b16, vit-l16, "
        "vit-tiny."
    ), proc.stderr[-2000:]
    proc = _estimax("train", "--family=vit", "--loss=hinge", f"--model_dir={tmp_path}")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "--loss" in proc.stderr


def test_declared_serving_preprocessing_is_the_eval_input_bit_for_bit():
    # big_vision's resize_small(256)|central_crop(224) region, as ResNet's eval crop of
    # 224/256 of the short side: the export declares it and the eval input computes it.
    import serving_fixtures as fx  # tests/ is on the path

    from estimax.data import preprocessing

    images, _ = fx.make_jpegs(6)
    for argv, size in ((["--model_name=vit-tiny"], 32), (["--input_image_size=64"], 64)):
        served = vit.serving_preprocessing(parse(argv))
        for jpeg in images:
            want = preprocessing.resnet_preprocess(jpeg, is_training=False, image_size=size)
            got = served(jpeg)
            assert got.dtype == np.uint8 and got.shape == (size, size, 3)
            np.testing.assert_array_equal(got, want)


def test_real_images_train_with_randaugment_and_mixup_and_the_export_is_checked(tmp_path):
    # JPEGs in the ImageNet layout (estimax-convert folder): the training input runs ResNet's
    # crop, RandAugment and mixup; the export declares its eval preprocessing and is checked
    # against Estimator.predict on validation images before it is published.
    from test_efficientnet import _write_data

    data = _write_data(str(tmp_path))
    export_dir = tmp_path / "export"
    # `estimax train --family=vit`: the family's program through the estimax command, in one
    # run for everything its command line promises (losses logged each step, the evaluation,
    # the flags recorded, the checked export).
    model_dir = tmp_path / "model"
    proc = _estimax(
        "train",
        "--family=vit",
        "--model_name=vit-tiny",
        f"--data_dir={data}",
        f"--model_dir={model_dir}",
        f"--export_dir={export_dir}",
        "--train_steps=4",
        "--steps_per_eval=4",
        "--iterations_per_loop=2",
        "--train_batch_size=8",
        "--eval_batch_size=8",
        "--num_train_images=16",
        "--num_eval_images=8",
        "--num_label_classes=10",
        "--warmup_steps=2",
        "--mixup_alpha=0.2",
        "--log_step_count_steps=1",
        "--num_parallel_calls=2",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAKE DATA" not in proc.stderr
    assert (
        "Eval results at step 4: top_1_accuracy = " in proc.stdout and "on 8 images" in proc.stdout
    )
    losses = [
        float(line.split("loss = ")[1].split(",")[0])
        for line in proc.stderr.splitlines()
        if "loss = " in line and ", step = " in line
    ]
    assert len(losses) == 4 and np.isfinite(losses).all()
    recorded = json.loads((model_dir / "flags.json").read_text())
    assert recorded["program"] == "vit" and recorded["flags"]["model_name"] == "vit-tiny"
    declared = json.loads((export_dir / "1" / "serving.json").read_text())["preprocessing"]
    assert (declared["params"]["size"], declared["params"]["crop_padding"]) == (32, 32)
    check = json.loads((export_dir / "1" / "export_check.json").read_text())
    assert len(check["inputs"]) == 8
