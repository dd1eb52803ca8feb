"""Resolve plug-ins (reward functions, environments) given as dotted import paths in the job YAML.

    fn = resolve_import_path("gspo_ray.envs.rewards:copy_reward", field="reward.fn")
    fn = resolve_import_path("my_pkg.rewards.score", field="reward.fn")      # module.attr form works too

`pkg.module:attr.sub` names the module explicitly (preferred: unambiguous); `pkg.module.attr` imports the longest
importable module prefix and walks the rest as attributes. Every error names the config field it came from, so a
typo in a YAML fails with `reward.fn: ...` before any Ray actor or engine is started.
"""
from __future__ import annotations

import importlib
import os
import re
import traceback
from typing import Any, Callable

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


class PluginError(ValueError):
    """A plug-in import path could not be resolved (the message names the config field)."""


def _is_missing(e: ModuleNotFoundError, name: str) -> bool:
    """True when `name` itself (or a parent package) does not exist, not when one of its own imports failed."""
    return e.name is not None and (name == e.name or name.startswith(e.name + "."))


def missing_module_hint(name: str) -> str:
    """Why a plug-in's module is not found, and what makes it importable (`gspo-ray` does not search the current
    directory: its sys.path starts at the console script's directory)."""
    top = name.split(".")[0]
    here = next((p for p in (f"{top}.py", f"{top}/__init__.py") if os.path.exists(p)), None)
    where = (f"{here} is in the current directory, which gspo-ray does not search: run with PYTHONPATH=." if here
             else "put its directory on PYTHONPATH")
    return (f"the module must be importable: {where} (on a cluster: cluster.runtime_env working_dir or "
            "env_vars.PYTHONPATH), or pip install it")


def _import_error(name: str, path: str, field: str, e: BaseException) -> PluginError:
    if isinstance(e, ModuleNotFoundError) and _is_missing(e, name):
        return PluginError(f"{field}: no module named {e.name!r} (from {path!r}); {missing_module_hint(e.name)}")
    return PluginError(f"{field}: importing module {name!r} (from {path!r}) failed: {type(e).__name__}: {e}")


def _import_module(name: str, path: str, field: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # missing module, or the user's module raised at import time
        raise _import_error(name, path, field, e) from e


def _get_attrs(obj: Any, attrs: list[str], module_name: str, path: str, field: str) -> Any:
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            owner = ".".join([module_name] + attrs[:i])
            public = sorted(a for a in dir(obj) if not a.startswith("_"))[:20]
            raise PluginError(f"{field}: {owner!r} has no attribute {attr!r} (from {path!r}); "
                              f"it has: {', '.join(public) or 'nothing public'}")
        obj = getattr(obj, attr)
    return obj


def _split_dotted(path: str, field: str) -> tuple[Any, str, list[str]]:
    """`a.b.c.d` -> (longest importable module, its name, remaining attributes)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            return importlib.import_module(name), name, parts[cut:]
        except ModuleNotFoundError as e:
            if _is_missing(e, name):
                continue  # this prefix is not a module: try a shorter one
            raise _import_error(name, path, field, e) from e
        except Exception as e:
            raise _import_error(name, path, field, e) from e
    raise PluginError(f"{field}: no module named {parts[0]!r} (from {path!r}); {missing_module_hint(parts[0])}")


def resolve_import_path(path: str, field: str = "import path") -> Any:
    """Import `pkg.module:attr` or `pkg.module.attr` and return the attribute; errors name `field`."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(f"{field}: expected an import path like 'pkg.module:attr', got {path!r}")
    path = path.strip()
    if path.count(":") > 1:
        raise PluginError(f"{field}: {path!r} has more than one ':'; expected 'pkg.module:attr'")
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        if not module_name or not attr_path:
            raise PluginError(f"{field}: {path!r} is not of the form 'pkg.module:attr'")
        module = _import_module(module_name, path, field)
        return _get_attrs(module, attr_path.split("."), module_name, path, field)
    if "." not in path:
        raise PluginError(f"{field}: {path!r} names no module; expected 'pkg.module:attr' or 'pkg.module.attr'")
    module, module_name, attrs = _split_dotted(path, field)
    return _get_attrs(module, attrs, module_name, path, field)


def resolve_callable(fn_or_path: str | Callable, field: str = "import path") -> Callable:
    """A callable as is, or the callable an import path names; anything else raises PluginError naming `field`."""
    fn = resolve_import_path(fn_or_path, field) if isinstance(fn_or_path, str) else fn_or_path
    if not callable(fn):
        raise PluginError(f"{field}: {fn_or_path!r} resolved to a {type(fn).__name__}, which is not callable")
    return fn


def raise_site(e: BaseException) -> str | None:
    """`file.py:LINE` of the frame that raised `e` (the innermost one), or None without a traceback. Failure
    reasons carry it so one bug is one group whatever its message says (coordinator/failures.py)."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else None


def traceback_site(text: str | None) -> str | None:
    """`raise_site` read back from a formatted traceback (what a child process sends)."""
    found = _FRAME.findall(text or "")
    return f"{os.path.basename(found[-1][0])}:{found[-1][1]}" if found else None
