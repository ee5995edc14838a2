"""The public API (docs/api.md): what tools see is what runs, and every name resolves."""

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import estimax

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The public modules, as docs/api.md lists them: each has an `__all__`.
PUBLIC_MODULES = [
    "estimax",
    "estimax.data",
    "estimax.data.imagenet",
    "estimax.data.preprocessing",
    "estimax.data.bigtable",
    "estimax.models",
    "estimax.ops",
    "estimax.export",
    "estimax.serving",
    "estimax.serving.rest",
    "estimax.migrate",
]


def _static_mirror() -> dict[str, str]:
    """Name -> module path, from the `if TYPE_CHECKING:` imports of estimax/__init__.py."""
    tree = ast.parse((ROOT / "estimax" / "__init__.py").read_text())
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "estimax/__init__.py needs one `if TYPE_CHECKING:` import block"
    mirror = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname is None, f"{alias.name} renamed in the mirror"
            mirror[alias.name] = node.module
    return mirror


def test_lazy_names_and_static_mirror_agree():
    lazy = {**estimax._EXPORTS, **estimax._SUBMODULES}
    mirror = _static_mirror()
    assert sorted(mirror) == sorted(lazy) == estimax.__all__
    for name, module in mirror.items():
        if name in estimax._SUBMODULES:
            # `from estimax.estimator import losses`: the submodule itself.
            assert f"{module}.{name}" == estimax._SUBMODULES[name]
            assert getattr(estimax, name) is importlib.import_module(f"{module}.{name}")
        else:
            assert module == estimax._EXPORTS[name], name
            assert getattr(estimax, name) is getattr(importlib.import_module(module), name)
    assert dir(estimax) == estimax.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        estimax.Nope  # noqa: B018


def test_importing_estimax_and_its_data_layer_imports_no_jax():
    """Input worker processes import estimax.data (so estimax): JAX stays out (1.8 s each)."""
    code = (
        "import sys, estimax, estimax.data, estimax.data.imagenet\n"
        "assert 'Estimator' in estimax.__all__ and 'Estimator' in dir(estimax)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_module_all_resolves(name):
    module = importlib.import_module(name)
    names = module.__all__
    assert len(set(names)) == len(names), f"{name}.__all__ has duplicates"
    assert names, name
    for attr in names:
        assert not attr.startswith("_"), f"{name}.{attr}"
        assert getattr(module, attr) is not None, f"{name}.{attr}"


def test_the_public_api_page_lists_the_public_modules():
    page = (ROOT / "docs" / "api.md").read_text()
    section = re.search(r"^# Public API\n(.*)", page, re.S | re.M)
    assert section, "docs/api.md needs its '# Public API' title"
    # The bullet list (items and their indented continuation lines) names the public modules.
    bullets = "".join(
        line for line in section.group(1).splitlines(True) if line.startswith(("- ", "  "))
    )
    listed = set(re.findall(r"`(estimax(?:\.[a-z_]+)*)`", bullets))
    assert listed == set(PUBLIC_MODULES)
