"""Reading a run configuration from what a user holds: a YAML file, a mapping, or a MineStudio config
file (`online_dict` in a .py file, read without running it where it is a plain literal)."""

from __future__ import annotations

import ast
import runpy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

GENERATORS = ("env_generator", "policy_generator")


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the key."""


# Keys MineStudio's shipped configs set and MineStudio itself never reads: accepted, warned about once.


def _literal_online_dict(path: Path, source: str) -> dict[str, Any] | None:
    """online_dict and the module-level generator functions of a MineStudio config file, read without
    running it (its imports - ray, hydra, minestudio - belong where the generators run, not here).
    None when online_dict is not a plain literal."""
    try:
        tree = ast.parse(source, str(path))
    except SyntaxError as err:
        raise ConfigError(f"config file {path}: line {err.lineno}: {err.msg}") from None
    data: dict[str, Any] | None = None
    functions = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions.add(node.name)
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "online_dict"
                                                     for t in node.targets)):
            try:
                data = ast.literal_eval(node.value)
            except ValueError:
                return None
    if data is None or not isinstance(data, dict):
        return None
    for key in GENERATORS:
        if key in functions and key not in data:
            data[key] = f"{path.resolve()}:{key}"
    return data


def _run_config_file(path: Path) -> dict[str, Any]:
    try:
        namespace = runpy.run_path(str(path))
    except Exception as err:  # the user's code: any error becomes one line naming the file
        raise ConfigError(f"config file {path}: {type(err).__name__}: {err}") from None
    if "online_dict" not in namespace:
        raise ConfigError(f"{path} defines no `online_dict`")
    online = namespace["online_dict"]
    if isinstance(online, DictConfig):
        online = OmegaConf.to_container(online, resolve=True)
    data = dict(online)
    # MineStudio quick starts define the generators next to online_dict.
    for key in GENERATORS:
        if callable(namespace.get(key)) and key not in data:
            data[key] = f"{path.resolve()}:{key}"
    return data


def read_user_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The run configuration as the user gave it: a mapping, an OmegaConf DictConfig, a YAML file, or a
    MineStudio config file (.py) defining `online_dict` (and perhaps the generators next to it)."""
    if isinstance(source, DictConfig):  # what a MineStudio user holds as online_cfg
        return cast(dict[str, Any], OmegaConf.to_container(source, resolve=True))  # a DictConfig's is a dict
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".py":
        return _literal_online_dict(path, path.read_text()) or _run_config_file(path)
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    return cast(dict[str, Any], loaded)  # YAML mapping keys: names, as a run config's are
