"""Model specs: a preset shipped as data, a local directory with ``config.json``, or a hub id.

Presets are JSON files in ``batchfit/models/presets/`` (``{"description", "hub_id",
"config"}``, ``config`` being a transformers ``config.json``). Only configurations are read:
models are built from them with random weights (:func:`batchfit.models.build_causal_lm`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import closest, short_repr

DEFAULT_PRESET = "tiny"


@cache
def _preset_files() -> dict[str, str]:
    folder = resources.files("batchfit.models") / "presets"
    return {
        entry.name[: -len(".json")]: entry.read_text(encoding="utf-8")
        for entry in folder.iterdir()
        if entry.name.endswith(".json")
    }


def list_presets() -> list[str]:
    """Names of the shipped presets, sorted (``"tiny"``, ``"qwen2.5-0.5b"``, ``"llama-3.1-8b"``, ...)."""
    return sorted(_preset_files())


def preset_info(name: str) -> dict[str, Any]:
    """The preset's JSON: ``{"description": str, "hub_id": str | None, "config": dict}``.

    Raises:
        InvalidArgument: ``name`` is not a preset (the presets are listed).
    """
    files = _preset_files()
    key = name.strip().lower()
    if key not in files:
        raise InvalidArgument(_unknown_spec_message(name))
    return json.loads(files[key])


# NOTE [ A preset answers for its hub id offline ]
# A framework's config names its model by hub id (ROLL's example: pretrain: Qwen/Qwen2.5-7B),
# and a machine without the network or a cached download could not read it. Each preset holds
# the config.json of the hub id it records (hub_id), so a hub id that is exactly a preset's,
# neither cached nor fetchable, is answered by that preset, with a warning; any other id (an
# -Instruct variant, another organisation) is still refused, since its config may differ.


_ANSWERED_BY_PRESET: set[str] = set()


def _preset_of_hub_id(spec: str) -> str | None:
    """The preset recorded from hub id ``spec`` (exact match), or ``None``."""
    for name in list_presets():
        if preset_info(name).get("hub_id") == spec:
            return name
    return None


def _preset_config(name: str, auto_config: Any) -> Any:
    """The transformers config of preset ``name``."""
    data = dict(preset_info(name)["config"])
    return auto_config.for_model(data.pop("model_type"), **data)


def _unknown_spec_message(spec: str) -> str:
    presets = list_presets()
    near = closest(spec.strip().lower(), presets)
    hint = f"; did you mean {near!r}?" if near else ""
    return f"spec must be a preset ({', '.join(presets)}), a local directory containing config.json, or a hub id such as 'Qwen/Qwen2.5-0.5B', but got spec={short_repr(spec)}{hint}"


def load_config(spec: Any = DEFAULT_PRESET, **overrides: Any) -> Any:
    """A transformers ``PretrainedConfig`` for ``spec``.

    Resolution order: a ``PretrainedConfig`` (copied); a transformers model (an
    ``nn.Module`` with a ``config``, bare or wrapped: its config, copied); a preset name
    (case-insensitive); a local directory containing ``config.json`` or a path to a
    ``.json`` file; a hub id ``"org/name"`` (downloads ``config.json`` only, when the network
    allows).

    Args:
        spec: see above; default ``"tiny"``.
        **overrides: config attributes to set, e.g. ``num_hidden_layers=2``.

    Returns:
        The config (a new object; the presets are never modified).

    Raises:
        InvalidArgument: unknown spec (lists the presets and the closest), a module without a
            transformers config, an unreadable config file, or a hub id that cannot be fetched.

    Example:
        >>> cfg = load_config("qwen2.5-0.5b")
        >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads
        (896, 24, 2)
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(spec, torch.nn.Module):
        spec = _module_config(spec)
    if isinstance(spec, PretrainedConfig):
        with quiet_transformers_logs():
            config = spec.__class__.from_dict(spec.to_dict())
    elif not isinstance(spec, (str, os.PathLike)):
        raise InvalidArgument(
            f"spec must be a preset name, a path, a hub id, a PretrainedConfig or a transformers model, but got {_short(spec)}; presets: {', '.join(list_presets())}"
        )
    else:
        with quiet_transformers_logs():
            config = _config_from_string(str(spec), AutoConfig)
    for key, value in overrides.items():
        setattr(config, key, value)
    return check_config(config, spec)


def _short(value: Any) -> str:
    """``spec=<repr> (<type>)`` when the repr is short, else ``a <type>`` (never a model's whole repr)."""
    text = repr(value)
    return f"spec={text} ({type(value).__name__})" if len(text) <= 60 and "\n" not in text else f"a {type(value).__name__}"


def spec_name(spec: Any) -> str:
    """How messages name a spec: a string as given, a config by its ``name_or_path`` or model type, else its type."""
    if isinstance(spec, (str, os.PathLike)):
        return repr(str(spec))
    config = getattr(getattr(spec, "module", spec), "config", spec)
    name = getattr(config, "name_or_path", "") or getattr(config, "model_type", "")
    return repr(str(name)) if name else f"a {type(spec).__name__}"


def _module_config(module: torch.nn.Module) -> Any:
    """The transformers config of a model, through DDP's ``.module`` wrapper.

    Raises:
        InvalidArgument: the module has no transformers config (named by its type, never its repr).
    """
    from transformers import PretrainedConfig

    inner = getattr(module, "module", module)  # DDP
    config = getattr(inner, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise InvalidArgument(
            f"spec must be a transformers model (with a config) to be built for each role, but got a {type(module).__name__} without one; "
            "pass its config or a preset, or measure your own step with batchfit.budget.find_token_budget(fn, backend=..., register=model)"
        )
    return config


def _known_model_types() -> tuple[str, ...]:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers layout changed
        return ()
    return tuple(CONFIG_MAPPING_NAMES)


# Integer fields every causal LM config has, which must be positive to build a model.
_POSITIVE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@cache
def _causal_lm_families() -> tuple[dict[str, Any], frozenset[str]]:
    """transformers' model types with a causal-LM class (type → class), and the encoder families among them.

    An encoder (BERT, RoBERTa, ...) or encoder-decoder family (BART, mBART) has a masked-LM or
    sequence-to-sequence class too; its causal class is a decoder bolted on (``is_decoder=True``).
    """
    from transformers.models.auto import modeling_auto

    causal = dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    encoders = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    encoders |= set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    return causal, frozenset(encoders)


@cache
def built_architectures() -> tuple[str, ...]:
    """The causal-LM classes of the presets' model types: what batchfit builds and is tested on (dense ones first)."""
    from types import SimpleNamespace

    from batchfit.models.moe import is_moe

    causal, _ = _causal_lm_families()
    kinds = {}
    for name in list_presets():
        config = preset_info(name)["config"]
        kinds[str(causal.get(config["model_type"], config["model_type"]))] = is_moe(SimpleNamespace(**config))
    return tuple(sorted(kinds, key=lambda cls: (kinds[cls], cls)))


def _not_a_causal_lm(config: Any, spec: Any) -> str | None:
    """Why ``config`` is no decoder-only causal LM (batchfit builds it with ``AutoModelForCausalLM``), or ``None``.

    A model type transformers has no causal-LM class for, or an encoder or encoder-decoder
    family (a masked-LM head such as ``BertForMaskedLM`` profiled as a causal LM would exit 0
    with numbers for a model nobody trains this way). A decoder's value or reward head
    (``LlamaForTokenClassification``, ``Qwen2ForSequenceClassification``) is its own family.
    """
    model_type = getattr(config, "model_type", None)
    if not model_type:  # a bare PretrainedConfig: nothing to judge
        return None
    causal, encoders = _causal_lm_families()
    if model_type in causal and model_type not in encoders and not getattr(config, "is_encoder_decoder", False):
        return None
    architectures = getattr(config, "architectures", None) or []
    what = f"architectures={short_repr(list(architectures))} (model_type={model_type!r})" if architectures else f"model_type={model_type!r}"
    why = f"{model_type} is an encoder or encoder-decoder family" if model_type in causal else f"transformers has no causal-LM class for {model_type}"
    return f"spec={spec_name(spec)}: {what} is not a causal language model ({why}); batchfit builds decoder-only causal LMs with transformers' AutoModelForCausalLM, such as {', '.join(built_architectures())}: point spec at such a model's config"


def check_config(config: Any, spec: Any) -> Any:
    """Reject configs a model cannot be built from, naming the field (before any tensor is made).

    Raises:
        InvalidArgument: no decoder-only causal LM (a BERT ``config.json``: names the
            architectures batchfit builds), a size field that is not a positive integer, or
            attention heads that do not divide the hidden size (without an explicit ``head_dim``).
    """
    refusal = _not_a_causal_lm(config, spec)
    if refusal is not None:
        raise InvalidArgument(refusal)
    for name in _POSITIVE_FIELDS:
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidArgument(
                f"spec={spec_name(spec)}: config field {name} must be a positive integer, but got {name}={short_repr(value)}"
            )
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1):
        raise InvalidArgument(
            f"spec={spec_name(spec)}: config field head_dim must be a positive integer (or left out: "
            f"hidden_size / num_attention_heads), but got head_dim={short_repr(head_dim)}"
        )
    if heads and hidden and head_dim is None and hidden % heads:
        raise InvalidArgument(
            f"spec={spec_name(spec)}: num_attention_heads={heads} must divide hidden_size={hidden} (or set head_dim)"
        )
    kv = getattr(config, "num_key_value_heads", None)
    if heads and kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or heads % kv):
        raise InvalidArgument(
            f"spec={spec_name(spec)}: num_key_value_heads={short_repr(kv)} must be a positive divisor of num_attention_heads={heads}"
        )
    return config


def _config_from_string(spec: str, auto_config: Any) -> Any:
    key = spec.strip().lower()
    if key in _preset_files():
        return _preset_config(key, auto_config)
    path = Path(spec).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long for a path (ENAMETOOLONG): not a directory, maybe a preset typo
        is_dir = False
    if is_dir or path.suffix == ".json":
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise InvalidArgument(
                f"spec={spec!r} is a path but {str(file)!r} does not exist; point spec at a directory containing config.json"
            )
        from batchfit.fileio import parse_json, read_text

        what = "the file"
        try:  # NOTE [ Untrusted input files ]: size, depth and integers bounded
            data = parse_json(read_text(file, what), what)
        except InvalidArgument as exc:
            raise InvalidArgument(
                f"spec={spec!r}: cannot read a transformers config from {str(file)!r} ({exc}); point spec at a config.json"
            ) from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise InvalidArgument(
                f"spec={spec!r}: {str(file)!r} must hold a JSON object with a 'model_type' field (a transformers config.json), but got {type(data).__name__}"
            )
        model_type = data.pop("model_type")
        known = _known_model_types()
        if known and model_type not in known:
            near = closest(str(model_type), list(known))
            hint = f"; did you mean {near!r}?" if near else ""
            raise InvalidArgument(
                f"spec={spec!r}: model_type={model_type!r} in {str(file)!r} is not a transformers model type{hint}"
            )
        try:
            return auto_config.for_model(model_type, **data)
        except Exception as exc:  # transformers validates values with several exception types
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise InvalidArgument(
                f"spec={spec!r}: transformers rejects the values in {str(file)!r}: {reason}"
            ) from exc
    if spec.count("/") == 1 and not spec.startswith(("/", ".")):
        try:  # a config cached by an earlier download needs no network
            return auto_config.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError):
            pass
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes")
        try:
            if offline:
                raise OSError("HF_HUB_OFFLINE is set and the config is not cached")
            unreachable = _hub_unreachable()
            if unreachable:
                raise OSError(unreachable)
            return auto_config.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            preset = _preset_of_hub_id(spec)
            if preset is not None:  # NOTE [ A preset answers for its hub id offline ]
                if spec not in _ANSWERED_BY_PRESET:  # once a process: a run loads its model's config several times
                    _ANSWERED_BY_PRESET.add(spec)
                    warnings.warn(
                        f"spec={spec!r} is not cached and the hub cannot be reached: using batchfit's preset {preset!r}, "
                        "recorded from that hub id's config.json",
                        stacklevel=2,
                    )
                return _preset_config(preset, auto_config)
            reason = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise InvalidArgument(
                f"spec={spec!r} looks like a hub id but its config is not cached and could not be fetched ({reason}); check the id and the network, or use a preset ({', '.join(list_presets())}) or a local directory with config.json (HF_HUB_OFFLINE=1 skips the network at once)"
            ) from exc
    raise InvalidArgument(_unknown_spec_message(spec))


# Seconds to wait for the hub's host before calling it unreachable: a machine without a
# network fails at once instead of after huggingface_hub's retries (about 30 s).
HUB_CONNECT_TIMEOUT = 3.0


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (DNS or TCP to ``HF_ENDPOINT``), or ``None`` if it can."""
    import socket
    from urllib.parse import urlparse

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT):
            return None
    except OSError as exc:
        return f"{host}:{port} is unreachable: {exc.strerror or exc}"


@contextlib.contextmanager
def quiet_transformers_logs() -> Iterator[None]:
    """Keep transformers' and huggingface_hub's warnings and retry logs off the terminal.

    Inside, only their errors are logged: what goes wrong reaches the user as one
    :class:`InvalidArgument` naming the spec, not as log lines printed before it.
    """
    loggers = [logging.getLogger(name) for name in ("transformers", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
