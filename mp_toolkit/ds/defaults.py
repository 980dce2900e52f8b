"""DeepSpeed's own defaults and refusals, for the keys a DeepSpeed config leaves out or must not hold.

A key absent from a DeepSpeed config means DeepSpeed's default, and that default moves between
releases (``gradient_clipping`` became 1.0 in 0.19.3; before, absent was no clipping). So the
values are read from the installed ``deepspeed`` package's sources when there is one, and from
0.19.x's documented defaults (`DOCUMENTED`) when there is none::

    d = deepspeed_defaults()
    d.source                 # "DeepSpeed 0.19.8", or "DeepSpeed 0.19.x (its documented defaults: ...)"
    d.gradient_clipping      # 1.0

The sources are parsed (``ast``), not imported: importing ``deepspeed`` picks an accelerator and
takes seconds, and a config reader must not. What is read, and from where in the package:

* ``runtime/constants.py``: ``GRADIENT_CLIPPING_DEFAULT``, ``FP16_<KEY>_DEFAULT`` for the six loss-scale
  keys, ``BFLOAT16_ENABLED_DEFAULT``;
* ``ops/lamb/fused_lamb.py``: the keyword defaults of ``FusedLamb.__init__`` (what ``"type": "Lamb"``
  builds, with ``optimizer.params`` as its keyword arguments);
* ``runtime/config.py``: the keys of ``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` and ``_REMOVED_ZERO_CONFIG_KEYS``,
  which ``DeepSpeedConfig`` refuses (``sparse_attention``, ``amp``, ``elasticity``, ...).

A value the installed package does not define as a plain literal keeps the documented one.
`tests/test_ds_parity.py` checks these against ``import deepspeed`` itself.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from mp_toolkit.optim.loss_scaler import LossScaleSettings


@dataclass(frozen=True)
class DeepSpeedDefaults:
    """What an absent key means to one DeepSpeed release, and which keys it refuses."""

    version: str
    """The DeepSpeed release: the installed one's version ("0.19.8"), or "0.19.x" for `DOCUMENTED`."""
    installed: bool = False
    """True when read from an installed deepspeed package."""
    gradient_clipping: float = 1.0
    """``GRADIENT_CLIPPING_DEFAULT``: the max global gradient norm when the key is absent."""
    fp16: LossScaleSettings = LossScaleSettings()
    """The ``fp16`` block's loss-scale keys (``FP16_*_DEFAULT``)."""
    bf16_enabled: bool = False
    """``BFLOAT16_ENABLED_DEFAULT``."""
    lamb: tuple[tuple[str, object], ...] = (("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
                                            ("eps", 1e-8), ("weight_decay", 0.0), ("max_coeff", 10.0),
                                            ("min_coeff", 0.01))
    """FusedLamb's keyword defaults, as (name, value) pairs."""
    removed_top: tuple[str, ...] = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                                    "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                                    "curriculum_learning", "progressive_layer_drop")
    """Top-level keys DeepSpeedConfig refuses (features removed from DeepSpeed)."""
    removed_zero: tuple[str, ...] = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")
    """``zero_optimization`` keys DeepSpeedConfig refuses."""

    @property
    def source(self) -> str:
        """Whose defaults these are, in words: "DeepSpeed 0.19.8" or "DeepSpeed 0.19.x (documented ...)"."""
        if self.installed:
            return f"DeepSpeed {self.version}"
        return f"DeepSpeed {self.version} (its documented defaults: deepspeed is not installed)"

    def lamb_default(self, name: str):
        """FusedLamb's default for keyword ``name``."""
        return dict(self.lamb)[name]


DOCUMENTED = DeepSpeedDefaults(version="0.19.x")
"""DeepSpeed 0.19.8's values, used when no deepspeed package is installed."""

_CONSTANTS = {"gradient_clipping": "GRADIENT_CLIPPING_DEFAULT", "bf16_enabled": "BFLOAT16_ENABLED_DEFAULT"}
"""Our field -> the name in ``deepspeed/runtime/constants.py``; the fp16 ones are ``FP16_<FIELD>_DEFAULT``."""


def _module(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _literal_assignments(tree: ast.Module) -> dict[str, object]:
    """Module-level ``NAME = literal`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def _dict_keys(tree: ast.Module, name: str) -> tuple[str, ...] | None:
    """The string keys of the module-level dict display ``name = {...}`` (its values may be f-strings)."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name and isinstance(node.value, ast.Dict)):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            return tuple(keys) if len(keys) == len(node.value.keys) else None
    return None


def _init_defaults(tree: ast.Module, cls: str) -> dict[str, object]:
    """Literal keyword defaults of ``cls.__init__`` in ``tree``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    args = f.args.args[len(f.args.args) - len(f.args.defaults):]
                    out = {}
                    for a, d in zip(args, f.args.defaults):
                        try:
                            out[a.arg] = ast.literal_eval(d)
                        except ValueError:
                            continue
                    return out
    return {}


def read_installed(root: Path, version: str) -> DeepSpeedDefaults:
    """The defaults of the deepspeed package whose folder is ``root`` (``.../site-packages/deepspeed``)."""
    values: dict[str, object] = {}
    constants = _module(root / "runtime" / "constants.py")
    if constants is not None:
        found = _literal_assignments(constants)

        def constant(name: str, default):
            v = found.get(name)
            return type(default)(v) if isinstance(v, (bool, int, float)) else default

        values = {field: constant(name, getattr(DOCUMENTED, field)) for field, name in _CONSTANTS.items()}
        values["fp16"] = LossScaleSettings(**{f.name: constant(f"FP16_{f.name.upper()}_DEFAULT", f.default)
                                              for f in dataclasses.fields(LossScaleSettings)})
    lamb = _module(root / "ops" / "lamb" / "fused_lamb.py")
    if lamb is not None:
        init = _init_defaults(lamb, "FusedLamb")
        values["lamb"] = tuple((k, tuple(init[k]) if k == "betas" and k in init else init.get(k, v))
                               for k, v in DOCUMENTED.lamb)
    config = _module(root / "runtime" / "config.py")
    if config is not None:
        for field, name in (("removed_top", "_REMOVED_TOP_LEVEL_CONFIG_KEYS"),
                            ("removed_zero", "_REMOVED_ZERO_CONFIG_KEYS")):
            keys = _dict_keys(config, name)
            values[field] = keys if keys is not None else ()  # a release before the removals refuses none
    return dataclasses.replace(DOCUMENTED, version=version, installed=True, **values)


@functools.cache
def deepspeed_defaults() -> DeepSpeedDefaults:
    """The installed DeepSpeed's defaults, or `DOCUMENTED` without one (its ``source`` says so)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return DOCUMENTED
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "(unknown version)"
    return read_installed(Path(next(iter(spec.submodule_search_locations))), version)
