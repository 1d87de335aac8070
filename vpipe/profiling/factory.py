"""A user's model for ``vpipe plan --model``: the factory named on the command line and its example input.

``MODULE:FACTORY`` names a function that takes no arguments and returns an ``nn.Module``, or
``(module, example_input)``; ``MODULE`` is a dotted module name (importable from the current
directory too, as with ``python -m``) or the path of a ``.py`` file. The example input is
one micro-batch: a tensor, a tuple of positional arguments, or a dict of keyword arguments;
a factory that returns only the module gets a tensor of ``--input-shape`` and
``--input-dtype`` (zeros for integer types, so token ids are valid for any vocabulary).

Everything that can go wrong with what the user typed or wrote raises ``ValueError`` with
one line that names the culprit, so the command ends with one ``vpipe: error:`` line.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ModelInput", "DTYPES", "load_model", "parse_shape", "parse_dtype", "one_line"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


@dataclass
class ModelInput:
    """The model to plan and one micro-batch to run it on."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    source: str  # what the user typed after --model


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``: user code's errors can span many lines."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# 1 GiB of float32: far beyond one micro-batch of any model profiled on one device
MAX_INPUT_ELEMENTS = 1 << 28


def parse_shape(text: str) -> tuple[int, ...]:
    """``8,128`` (or ``8x128``) as a shape; every dimension a positive integer."""
    parts = text.replace("x", ",").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ValueError("--input-shape must be positive integers separated by commas, "
                         f"like 8,128; got {text!r}")
    elements = math.prod(dims)
    if elements > MAX_INPUT_ELEMENTS:
        raise ValueError(f"--input-shape {text} is {elements:.3g} elements per micro-batch; "
                         "profiling runs the model "
                         f"on it, so at most {MAX_INPUT_ELEMENTS:.3g} (one micro-batch, not the whole batch)")
    return dims


def parse_dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower().removeprefix("torch.")]
    except KeyError:
        names = ", ".join(n for n in DTYPES if n not in ("float", "half", "double", "long", "int"))
        raise ValueError(f"--input-dtype must be one of {names}; got {text!r}") from None


def _not_a_file(path: Path, text: str) -> str:
    """Why ``path`` is not a Python file to load: missing, or what it is instead (a FIFO, a directory ...)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return f"no file {text!r}"
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")
    return f"{text!r} is {kind}, not a Python file"


def _import(module_text: str) -> Any:
    if module_text.endswith(".py") or "/" in module_text:
        path = Path(module_text)
        if not path.is_file():
            raise ValueError(f"--model: {_not_a_file(path, module_text)}")
        spec = importlib.util.spec_from_file_location(f"_vpipe_model_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--model: cannot load {module_text!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
        sys.path.insert(0, str(path.resolve().parent))  # its own imports of modules beside it
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's module: report it, do not crash
            del sys.modules[spec.name]
            raise ValueError(f"--model: importing {module_text!r} raised {one_line(e)}") from None
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: modules in the current directory import
    try:
        return importlib.import_module(module_text)
    except ModuleNotFoundError as e:
        raise ValueError(f"--model: cannot import module {module_text!r} ({e})") from None
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--model: importing {module_text!r} raised {one_line(e)}") from None


def _split_input(example: Any, what: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, tuple | list):
        return tuple(example), {}
    if isinstance(example, dict) and all(isinstance(k, str) for k in example):
        return (), dict(example)
    raise ValueError(f"{what}'s example input is {type(example).__name__}; it must be a tensor, a tuple of "
                     "positional arguments or a dict of keyword arguments")


def load_model(spec: str, shape_text: str | None = None, dtype_text: str | None = None) -> ModelInput:
    """Import and call the factory ``spec`` (``MODULE:FACTORY``), and make its example input."""
    module_text, sep, name = spec.rpartition(":")
    if not sep or not module_text or not name.isidentifier():
        raise ValueError(f"--model must be MODULE:FACTORY (a module or .py file, a colon, a function name), "
                         f"e.g. mypkg.models:build; got {spec!r}")
    dtype = parse_dtype(dtype_text) if dtype_text is not None else None
    shape = parse_shape(shape_text) if shape_text is not None else None
    factory = getattr(_import(module_text), name, None)
    if factory is None:
        raise ValueError(f"--model: {module_text!r} has no {name!r}")
    if not callable(factory):
        raise ValueError(f"--model: {spec} is {type(factory).__name__}, not a function")
    try:
        made = factory()
    except SystemExit as e:  # the user's code ending the process would end `vpipe plan` silently, even with 0
        raise ValueError(
            f"--model: {spec}() called sys.exit({e.code!r}) instead of returning a model"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's code
        raise ValueError(f"--model: {spec}() raised {one_line(e)}") from None
    example = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, example = made
    if not isinstance(made, nn.Module):
        raise ValueError(f"--model: {spec}() returned {type(made).__name__}; it must return an nn.Module "
                         "or (nn.Module, example input)")
    if example is not None:
        if shape is not None or dtype is not None:
            raise ValueError(f"--input-shape and --input-dtype are for factories that return only a model; "
                             f"{spec}() returns its own example input")
        args, kwargs = _split_input(example, f"{spec}()")
    else:
        if shape is None:
            raise ValueError(f"--input-shape is needed: {spec}() returns a model without an example input")
        dtype = dtype or torch.float32
        tensor = torch.randn(shape, dtype=dtype) if dtype.is_floating_point else torch.zeros(shape,
                                                                                             dtype=dtype)
        args, kwargs = (tensor,), {}
    return ModelInput(made, args, kwargs, spec)
