"""Components by ``_target_``: a config node ``{_target_: package.module.callable, **kwargs}``
names a callable (a class or a function) and its keyword arguments. The worker adds what only
it knows at run time (the model's sizes from the data, the optimizer's parameters, ...), and only
the names the callable declares. Before any worker starts, ``check`` holds the node against the
callable's own signature (as torchtune's config validation does): an unknown key, a missing
one, a value of the wrong type, or a value the component's own ``check_config`` refuses is a
``ConfigError`` naming the key and what is allowed.

No Hydra here: components are plain Python; this module only locates and calls them.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

RESERVED = ("_target_", "_partial_")


class ConfigError(ValueError):
    """Bad configuration: reported as one line naming the key and what is allowed."""


class ContractError(TypeError):
    """A component broke its contract at run time (a data set's loss returning a mean instead
    of per-sample sums and counts, say): one line naming the component, what it returned and
    what is expected."""


def require(ok: bool, key: str, allowed: str, got: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={got!r} is not allowed: {allowed}")


def require_extra(module: str, extra: str, what: str) -> Any:
    """``module`` imported, or ConfigError in one line naming the extra that installs it
    (pyproject.toml [project.optional-dependencies]): ``what`` needs ``module``: pip install
    'gradsync[extra]'. A module that is there but fails to import is reported as what it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the module is there; something it imports is not
        raise ConfigError(f"{what} needs {module.split('.')[0]}: pip install "
                          f"'gradsync[{extra}]'") from None


def reason(e: BaseException) -> str:
    """What an exception says, as one line: from the innermost cause that says something
    (transformers' config validation raises an error whose first line only names the
    validator; its cause holds the reason), or, for a bare ``assert``, the statement that
    failed (nanoGPT's ``assert config.n_embd % config.n_head == 0``)."""
    inner: BaseException = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    for x in (inner, e):
        text = next((ln.strip() for ln in str(x).splitlines() if ln.strip()), "")
        if text:
            return f"{type(x).__name__}: {text}"
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, AssertionError) and frames and frames[-1].line:
        return f"AssertionError: {frames[-1].line} failed"
    return type(e).__name__


def kind_of(obj: Any) -> str:
    """What a component returned, for messages: None, a list, a Linear..."""
    return "None" if obj is None else f"a {type(obj).__qualname__}"


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): what a check
    holds sizes against that no run here could allocate."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def require_fits(nbytes: float, what: str) -> None:
    """Refuse what would take more than this machine's memory (nbytes, counted from the
    config before anything is allocated): `what` names the keys it comes from."""
    memory = machine_memory()
    if memory is not None and nbytes > memory:
        raise ConfigError(f"{what} would take {_size(nbytes)}, more than this machine's memory "
                          f"({_size(memory)})")


def _size(nbytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def checks(check: Callable[..., None]) -> Callable[[Any], Any]:
    """Decorator: attach a component's own range checks, ``check(args, ctx)`` where ``args`` is
    the keyword arguments it will get (defaults filled in) and ``ctx`` a ``CheckContext``. The
    check raises ConfigError through ``require``."""

    def attach(target: Any) -> Any:
        target.check_config = check
        return target

    return attach


def describes(describe: Callable[..., dict[str, Any]]) -> Callable[[Any], Any]:
    """Decorator: attach ``describe(**kwargs) -> dict``, called with the component's configured
    keyword arguments (defaults filled in) by the launcher, before any worker starts: what
    run_info.json records of it (a corpus's digest and size, say). It must be cheap."""

    def attach(target: Any) -> Any:
        target.run_info = describe
        return target

    return attach


@dataclass
class CheckContext:
    """What a component's check may look at besides its own arguments."""

    group: str  # the config group, for error messages ("model", "sync", ...)
    world_size: int = 1
    precision: str = "fp32"
    provided: dict[str, Any] = field(default_factory=dict)  # runtime arguments, when known


def cwd_importable() -> None:
    """A user's module next to where they run (like ``python -m``) can be a ``_target_``: the
    console script does not put the working directory on sys.path, so put it last. Spawned
    workers inherit sys.path."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def locate(path: str, key: str = "_target_") -> Any:
    """The object named by a dotted path ``package.module.attr`` (attr may be nested)."""
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}={path!r} is not allowed: a dotted path "
                          "package.module.callable")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # this prefix is no module: try a shorter one
            raise ConfigError(f"{key}={path!r}: importing {module_name} failed: {e}") from None
        except Exception as e:
            raise ConfigError(f"{key}={path!r}: importing {module_name} failed: "
                              f"{type(e).__name__}: {e}") from None
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            raise ConfigError(f"{key}={path!r}: {module_name} has no "
                              f"{'.'.join(parts[cut:])}") from None
        if not callable(obj):
            raise ConfigError(f"{key}={path!r} is not callable")
        return obj
    raise ConfigError(f"{key}={path!r}: no module {parts[0]!r} (is it installed, or importable "
                      "from the directory you run in?)")


def parameters(target: Any) -> dict[str, inspect.Parameter]:
    """The keyword-passable parameters of a callable (a class: its constructor's)."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return {}
    return {n: p for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes_any_keyword(target: Any) -> bool:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def hints(target: Any) -> dict[str, Any]:
    fn = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(fn)
    except Exception:  # annotations that do not resolve here: no type check
        return {}


def accepts(hint: Any, value: Any) -> bool:
    """A conservative type check: only plain scalars, lists and their unions are checked."""
    if hint is Any or value is None and _is_optional(hint):
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(h, value) for h in typing.get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple, Iterable) or hint in (list, tuple):
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[X, Y]: fixed length
            return len(value) == len(args) and all(map(accepts, args, value))
        return not args or all(accepts(args[0], v) for v in value)
    return True  # anything else (dicts, classes, callables): the component checks it


def _is_optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


# What a value of each plain type is called in an error line: (one, several).
TYPE_WORDS: dict[Any, tuple[str, str]] = {
    int: ("an integer", "integers"), float: ("a float", "floats"),
    bool: ("true or false", "booleans"), str: ("a string", "strings"),
    type(None): ("null", "nulls"), dict: ("a mapping", "mappings")}


def type_text(hint: Any, several: bool = False) -> str:
    """A type hint in words, as a config value spells it (a tuple is a YAML list):
    ``tuple[float, float]`` -> "a list of 2 floats", ``bool | None`` -> "true or false, or
    null". Types no config value can be (a Tensor beside a float) are left out of unions."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [h for h in typing.get_args(hint) if _spellable(h)] or [*typing.get_args(hint)]
        words = list(dict.fromkeys(type_text(h, several) for h in args))
        return ", or ".join(words) if len(words) > 1 else words[0]
    if hint in TYPE_WORDS:
        return TYPE_WORDS[hint][several]
    if origin in (list, tuple, Iterable) or hint in (list, tuple):
        args = [*typing.get_args(hint)]
        lists = "lists" if several else "a list"
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length
            kinds = {type_text(a, True) for a in args}
            if len(kinds) == 1:
                return f"{lists} of {len(args)} {kinds.pop()}"
            return f"{lists} of {len(args)}: " + ", ".join(type_text(a) for a in args)
        return f"{lists} of {type_text(args[0], True)}" if args else lists
    if origin is dict:
        return TYPE_WORDS[dict][several]
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _spellable(hint: Any) -> bool:
    """Whether a config value (YAML) can be of this type."""
    origin = typing.get_origin(hint)
    return hint in TYPE_WORDS or hint in (list, tuple) or origin in (
        list, tuple, dict, Iterable, typing.Union, types.UnionType)


def renamed_line(old: str, new: str) -> str:
    """The one line an option answers its old name with (config/renames.py for settings, a
    target's ``renamed`` for a component's own keyword)."""
    return f"{old} was renamed: use {new}"


def renamed_option(target: Any, group: str, key: str) -> str | None:
    """renamed_line for `group.key` where the target renamed that keyword (its ``renamed``
    mapping, old name -> new: sync/policy.py RENAMED), else None."""
    new = getattr(target, "renamed", {}).get(key)
    return None if new is None else renamed_line(f"{group}.{key}", f"{group}.{new}")


def check(group: str, node: dict[str, Any], runtime: Iterable[str],
          ctx: CheckContext | None = None, extra: Iterable[str] = ()) -> Any:
    """Hold a config node against its target's signature and the target's own check_config.
    runtime: names the worker passes itself (they may not be set in the config); extra: keys of
    the node that are not the target's (keys the loop reads rather than the target). Returns the
    target."""
    if not isinstance(node, dict) or "_target_" not in node:
        raise ConfigError(f"{group}: needs a _target_ (package.module.callable) and its "
                          "keyword arguments")
    target = locate(node["_target_"], f"{group}._target_")
    params = parameters(target)
    runtime, extra = set(runtime), set(extra)
    accepted = sorted(n for n in params if n not in runtime)
    keys = f"accepted keys: {', '.join(accepted)}" if accepted else "it takes no keys"
    args = config_args(node, extra)
    for key in args:
        if key in runtime:
            raise ConfigError(f"{group}.{key}: set by gradsync at run time, not in the config "
                              f"({keys})")
        message = renamed_option(target, group, key)
        if message:
            raise ConfigError(message)
        if key not in params and not takes_any_keyword(target):
            raise ConfigError(f"{group}.{key}: unknown key for {node['_target_']}; {keys}")
    for name, p in params.items():
        if p.default is p.empty and name not in args and name not in runtime \
                and not node.get("_partial_"):
            raise ConfigError(f"{group}.{name}: missing; {node['_target_']} requires it")
    hints_ = hints(target)
    for key, value in args.items():
        if is_node(value):  # a nested component (GPT's GPTConfig): checked as its own
            check(f"{group}.{key}", value, runtime, ctx)
            continue
        hint = hints_.get(key)
        if hint is not None and not accepts(hint, value):
            raise ConfigError(f"{group}.{key}={value!r} is not allowed: {node['_target_']} "
                              f"takes {type_text(hint)}")
    own = getattr(target, "check_config", None)
    if own is not None:
        own(_with_defaults(params, args, runtime), ctx or CheckContext(group))
    return target


def is_node(value: Any) -> bool:
    """A nested component: a mapping with its own ``_target_`` (built before the callable that
    takes it, as Hydra's instantiate builds nested nodes)."""
    return isinstance(value, dict) and "_target_" in value


def config_args(node: dict[str, Any], extra: Iterable[str] = ()) -> dict[str, Any]:
    """The keyword arguments a node sets for its target: all its keys but ``_target_``,
    ``_partial_`` and ``extra`` (keys the loop reads, not the target)."""
    skip = set(extra)
    return {k: v for k, v in node.items() if k not in RESERVED and k not in skip}


def _with_defaults(params: dict[str, inspect.Parameter], args: dict[str, Any],
                   runtime: Iterable[str]) -> dict[str, Any]:
    """The keyword arguments a component gets from its config: its defaults, then the node's."""
    runtime = set(runtime)
    full = {n: p.default for n, p in params.items()
            if p.default is not p.empty and n not in runtime}
    return full | args


def describe(node: dict[str, Any], runtime: Iterable[str] = (),
             extra: Iterable[str] = ()) -> dict[str, Any] | None:
    """What the node's target says of itself through ``@describes`` (None: nothing), called
    with its configured arguments; runtime arguments are left out (the target's describe
    must not need them)."""
    target = locate(node["_target_"])
    own = getattr(target, "run_info", None)
    if own is None:
        return None
    args = config_args(node, extra)
    full = _with_defaults(parameters(target), args, runtime)
    return own(**{k: v for k, v in full.items() if k in parameters(own)})


def build(node: dict[str, Any], runtime: dict[str, Any] | None = None,
          extra: Iterable[str] = ()) -> Any:
    """Call the node's target with its keyword arguments plus those of ``runtime`` that the
    target declares (a target that takes ``**kwargs`` gets them all). A keyword argument that
    is itself a node (``_target_``) is built first, offered the same runtime arguments
    (nanoGPT's ``GPT(config)``: its ``GPTConfig`` gets the data's ``vocab_size``).
    ``_partial_: true`` returns a functools.partial instead (the optimizer, which gets its
    parameters later)."""
    import functools

    target = locate(node["_target_"])
    params = parameters(target)
    anything = takes_any_keyword(target)
    kwargs = {k: build(v, runtime) if is_node(v) else v
              for k, v in config_args(node, extra).items()}
    kwargs.update({k: v for k, v in (runtime or {}).items() if k in params or anything})
    if node.get("_partial_"):
        return functools.partial(target, **kwargs)
    return target(**kwargs)

