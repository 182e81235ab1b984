"""--te-precision-config-file: Megatron's per-module precision file, read and checked.

The format is Megatron's (megatron/core/extensions/TransformerEngineMixedPrecision.md): named ``configs`` (each a
``TEQuantizationParams`` with a ``training_recipe``) and ordered ``matchers`` (glob patterns over the modules' names,
e.g. ``*.self_attention.linear_qkv``, each choosing one config). The first enabled matcher whose pattern matches a
module's name chooses its precision; modules no matcher takes keep the run's. As in Megatron, a file only overrides
modules the run quantises: with ``--fp8-format`` every transformer linear (attention's, the MLPs', the routed
experts' grouped GEMMs), less those ``--first-last-layers-bf16`` keeps in bf16.

A training recipe ``{}`` keeps the module in the parameters' dtype (bf16); ``fp8_quantization_recipe: NAME`` runs it
in FP8 with one of paratron's recipes (tensorwise, delayed, blockwise) and the run's other FP8 settings. What paratron
does not have is refused by name: FP4 recipes, ``mxfp8`` (Blackwell), and an ``evaluation_recipe`` other than the
training one (paratron evaluates each module in the precision it trains in).
"""
from __future__ import annotations

import fnmatch
from typing import NamedTuple, Optional

from ..errors import ConfigError
from .values import FP8_RECIPES, FP8_REFUSED_RECIPES

CONFIG_TYPE = "TEQuantizationParams"


class Rule(NamedTuple):
    """One enabled matcher: its name, glob pattern, and the FP8 recipe it chooses (None: high precision)."""
    matcher: str
    pattern: str
    recipe: Optional[str]


def _fail(path: str, what: str) -> None:
    raise ConfigError(f"--te-precision-config-file {path}: {what}")


def _recipe_of(path: str, name: str, entry) -> Optional[str]:
    """The FP8 recipe a ``configs`` entry trains with (None: high precision)."""
    if not isinstance(entry, dict):
        _fail(path, f"configs.{name} must be a mapping with transformer_engine_config_type and training_recipe")
    kind = entry.get("transformer_engine_config_type")
    if kind != CONFIG_TYPE:
        _fail(path, f"configs.{name}: transformer_engine_config_type must be {CONFIG_TYPE} (got {kind!r})")
    unknown = sorted(set(entry) - {"transformer_engine_config_type", "training_recipe", "evaluation_recipe"})
    if unknown:
        _fail(path, f"configs.{name}: unknown key {unknown[0]!r}; a config has transformer_engine_config_type, "
                    "training_recipe and evaluation_recipe")
    train = entry.get("training_recipe")
    if not isinstance(train, dict):
        _fail(path, f"configs.{name}: training_recipe must be a mapping ({{}} for bf16, or fp8_quantization_recipe)")
    if "evaluation_recipe" in entry and entry["evaluation_recipe"] != train:
        _fail(path, f"configs.{name}: an evaluation_recipe other than its training_recipe is not implemented "
                    "(paratron evaluates each module in the precision it trains in); remove evaluation_recipe")
    for key in train:
        if key.startswith("fp4"):
            _fail(path, f"configs.{name}: {key} is not supported: paratron has no FP4 matmuls (they need Blackwell); "
                        "use fp8_quantization_recipe or {}")
        if key != "fp8_quantization_recipe":
            _fail(path, f"configs.{name}: unknown training_recipe key {key!r}; use fp8_quantization_recipe or {{}}")
    recipe = train.get("fp8_quantization_recipe")
    if recipe is None:
        return None
    if recipe in FP8_REFUSED_RECIPES:
        _fail(path, f"configs.{name}: fp8_quantization_recipe {recipe} is not supported: "
                    f"{FP8_REFUSED_RECIPES[recipe]}; use one of {', '.join(FP8_RECIPES)}")
    if recipe not in FP8_RECIPES:
        _fail(path, f"configs.{name}: fp8_quantization_recipe must be one of {', '.join(FP8_RECIPES)} (got {recipe!r})")
    return recipe


def read_rules(path: Optional[str]) -> tuple[Rule, ...]:
    """The enabled matchers of the file at ``path``, in order (none without a file: ``path`` None); raises
    ConfigError (one line) on any problem."""
    if not path:
        return ()
    import yaml
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--te-precision-config-file {path}: cannot read it ({e.strerror}); give the path of the "
                          "YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--te-precision-config-file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict) or not isinstance(doc.get("matchers"),
                                                                                                dict):
        _fail(path, "the file must hold two mappings, configs and matchers (Megatron's format)")
    unknown = sorted(set(doc) - {"configs", "matchers"})
    if unknown:
        _fail(path, f"unknown top-level key {unknown[0]!r}; the file holds configs and matchers")
    recipes = {name: _recipe_of(path, name, entry) for name, entry in doc["configs"].items()}
    rules = []
    for name, m in doc["matchers"].items():
        if not isinstance(m, dict):
            _fail(path, f"matchers.{name} must be a mapping with type, pattern, config and enabled")
        unknown = sorted(set(m) - {"type", "pattern", "config", "enabled"})
        if unknown:
            _fail(path, f"matchers.{name}: unknown key {unknown[0]!r}; a matcher has type, pattern, config, enabled")
        if m.get("type") != "glob":
            _fail(path, f"matchers.{name}: type must be glob (the only matcher type), got {m.get('type')!r}")
        if not isinstance(m.get("pattern"), str) or not m["pattern"]:
            _fail(path, f"matchers.{name}: pattern must be a glob over module names, e.g. "
                        "'*.self_attention.linear_qkv'")
        if m.get("config") not in recipes:
            _fail(path, f"matchers.{name}: config {m.get('config')!r} is not one of configs ({', '.join(recipes)})")
        enabled = m.get("enabled", True)
        if not isinstance(enabled, bool):
            _fail(path, f"matchers.{name}: enabled must be true or false (got {enabled!r})")
        if enabled:
            rules.append(Rule(str(name), m["pattern"], recipes[m["config"]]))
    return tuple(rules)


def first_match(rules: tuple[Rule, ...], name: str) -> Optional[Rule]:
    """The rule that chooses the precision of the module called ``name`` (Megatron's name), None when none does."""
    for rule in rules:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    return None


def fp8_recipes(tr) -> set:
    """The FP8 recipes a run (its TrainConfig ``tr``) uses: ``--fp8-recipe`` and the ones its
    ``--te-precision-config-file`` names; empty without ``--fp8-format``."""
    if tr.fp8_format is None:
        return set()
    return {tr.fp8_recipe} | {r.recipe for r in read_rules(tr.te_precision_config_file)} - {None}
