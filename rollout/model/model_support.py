"""Which models the paged engine decodes exactly, decided before the first forward.

The engine runs a Hugging Face model's own modules and swaps only its attention function
(``attention.py``), so a family is exact when every token-mixing module of its decoder attends
through transformers' ``AttentionInterface`` with arguments the paged function implements, keeps
no state of its own across forwards, and hands the cache K/V of a shape it can hold. Everything
else decodes wrong tokens with no error, so it is refused here, in one line naming the family,
the layer class and what is missing.

Two checks, both from what the code declares rather than from running it:

* **the model's modules** (:func:`module_traits`, read once per class from its source): a module
  that calls the attention function passes keyword arguments (all must be in
  :data:`HONOURED_KEYWORDS`); one that reads or writes a recurrent state (Mamba, linear attention,
  short convolutions, RG-LRU) keeps a state the paged cache does not hold, except the Gated DeltaNet
  layers whose state the engine keeps in slots beside it (``recurrent_state.py``: plain decoding
  only, the engine refuses speculative strategies for them); a decoder layer with neither mixes
  tokens some other way.
* **the family** (:data:`SERVED_FAMILIES`): a family whose modules pass the first check may still
  compute something from the whole input (learned positions counted from its length, a relative
  bias, an ALiBi table) that a packed forward of new tokens breaks; only the families
  ``tests/rollout/model/test_model_support.py`` measured exact against a no-cache recompute are
  served, and a family transformers adds later is refused until it is measured.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass

import torch

from .delta_rule_rows import ROW_VERIFIED
from .kv_cache import KVLayout
from .layer_taps import decoder_of
from .recurrent_state import RECURRENT_MIXERS, RecurrentStates, recurrent_mixers, slots_preserved

# what ``paged_attention_forward`` takes beyond query, key, value and mask: ``dropout`` is 0 in
# eval mode, ``is_causal`` is the paged mask's own, ``position_ids`` and ``output_attentions``
# change nothing the function returns; ``s_aux`` (gpt-oss's sinks) and ``softcap`` (Gemma 2's
# logit cap) are applied
HONOURED_KEYWORDS = frozenset(
    {"attention_mask", "dropout", "scaling", "sliding_window", "is_causal", "position_ids", "output_attentions"}
    | {"s_aux", "softcap"}
)

# the model types measured exact with every strategy the family runs (the family walk in the
# tests: engine logprobs against a no-cache recompute, and greedy tokens against HF's)
SERVED_FAMILIES = frozenset(
    {
        "afmoe", "apertus", "arcee", "aria_text", "axk1", "beam", "biogpt", "bitnet", "cohere", "cohere2",
        "cohere2_moe", "ctrl", "cwm", "deepseek_v2", "deepseek_v3", "doge", "ernie4_5", "ernie4_5_moe",
        "exaone4", "exaone_moe", "falcon_h1", "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3", "gemma3_text",
        "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
        "glm4_moe_lite", "got_ocr2", "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "granite",
        "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "helium", "hy_v3", "hyperclovax",
        "internlm3", "iquestcoder", "jais2", "jetmoe", "kimi_linear", "kolibri1", "laguna", "lfm2", "llama", "mellum",
        "mimo_v2_flash", "minicpm3", "minimax_m2", "ministral3", "mistral", "mixtral", "modernbert-decoder",
        "moshi", "moss_transcribe_diarize", "nanochat", "nemotron_h", "olmo", "olmo2", "olmo3", "olmoe", "opt",
        "persimmon",
        "phi", "phi3", "phi4_multimodal", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_5", "qwen3_5_moe",
        "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "seed_oss",
        "smollm3", "solar_open", "starcoder2", "vaultgemma", "youtu",
    }
)  # fmt: skip

# cache calls and attributes of layers that carry a state from one forward to the next
_STATE = re.compile(
    r"\b(update_conv_state|get_conv_state|update_recurrent_state|get_recurrent_state|rnn_state|"
    r"conv1d_state|recurrent_states|ssm_states|conv_states)\b"
)
# attention computed by the module itself, not through the interface the engine swaps
_OWN_ATTENTION = re.compile(
    r"^(eager_attention_forward|scaled_dot_product_attention|flash_attn\w*|\w*attention_forward)$"
)


class UnservableModel(ValueError):
    """A model the engine cannot decode exactly; the message is one line naming what is missing."""


@dataclass(frozen=True)
class ModuleTraits:
    """What a module class's code does with the sequence, read from its source."""

    attention_keywords: frozenset[str] | None  # keywords of its attention-function call; None: no call
    keeps_state: bool  # reads or writes a state that outlives a forward
    attends_itself: bool  # computes attention without the interface


def _interface_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "attention_interface"
    if isinstance(func, ast.Subscript):  # ALL_ATTENTION_FUNCTIONS[...](...)
        return "ATTENTION_FUNCTIONS" in ast.unparse(func.value)
    if isinstance(func, ast.Call) and isinstance(func.func, ast.Attribute):  # ...get_interface(...)(...)
        return func.func.attr == "get_interface"
    return False


def _called_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


@functools.cache
def module_traits(cls: type) -> ModuleTraits:
    """The traits of ``cls``'s own code and its transformers bases' (torch's are not read)."""
    keywords: set[str] | None = None
    state = attends = False
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers.") or klass.__module__.startswith("transformers.modeling_"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        state = state or bool(_STATE.search(source))
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Call):
                continue
            if _interface_call(node):
                keywords = (keywords or set()) | {k.arg for k in node.keywords if k.arg is not None}
            elif _OWN_ATTENTION.match(_called_name(node)):
                attends = True
    return ModuleTraits(frozenset(keywords) if keywords is not None else None, state, attends)


def family_of(model: torch.nn.Module) -> str:
    return str(getattr(model.config, "model_type", None) or type(model).__name__)


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder's blocks: its ``layers``, else the largest list of same-class blocks (GPT-2's ``h``)."""
    layers = getattr(decoder_of(model), "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return layers
    stacks = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1
    ]
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def check_model(model: torch.nn.Module, role: str = "model") -> None:
    """Refuse ``model`` (``role``: what it is to the engine, for the message) unless the paged
    engine decodes it exactly; see the module doc. Raises :class:`UnservableModel`."""
    family = family_of(model)

    def refuse(what: str) -> UnservableModel:
        return UnservableModel(f"{role} family {family!r}: {what}; tailspec would decode it wrong, so it refuses it")

    layers = _layers(model)
    if layers is None:
        raise refuse(f"{type(model).__name__} has no decoder layer stack the paged engine can drive")
    for i, layer in enumerate(layers):
        attends = False
        for module in layer.modules():
            traits = module_traits(type(module))
            where = f"{type(module).__name__} (layer {i})"
            if type(module).__name__ in RECURRENT_MIXERS:  # its state in slots beside the paged cache
                attends = True
                continue
            if traits.keeps_state:
                raise refuse(f"{where} keeps a recurrent state across forwards, which the paged cache does not hold")
            if traits.attention_keywords is not None:
                missing = ", ".join(sorted(traits.attention_keywords - HONOURED_KEYWORDS))
                if missing:
                    raise refuse(f"{where} passes {missing} to attention, which paged attention does not implement")
                attends = True
            elif traits.attends_itself:
                raise refuse(f"{where} computes its attention itself, outside transformers' AttentionInterface")
        if not attends and not _token_wise(layer):
            raise refuse(f"{type(layer).__name__} (layer {i}) mixes tokens without transformers' AttentionInterface")
    if family not in SERVED_FAMILIES:
        raise refuse("not among the families measured exact against a no-cache recompute (README, 'Models')")


def _token_wise(layer: torch.nn.Module) -> bool:
    """A decoder block that declares it mixes no tokens: Nemotron-H's MLP and MoE blocks (its
    ``block_type``; the family's token mixers are its attention and Mamba-2 blocks)."""
    return type(layer).__name__ == "NemotronHBlock" and layer.block_type in ("mlp", "moe")


def _attention_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    return next((m for m in layer.modules() if module_traits(type(m)).attention_keywords is not None), None)


def _cache_shape(module: torch.nn.Module, text_config) -> tuple[int, int, int]:
    """``(kv_heads, key size, value size)`` of what ``module`` hands the attention function, from
    what it declares: its own head size (per layer in Gemma 4), MLA's ``qk_head_dim`` and
    ``v_head_dim``, and its K/V heads (its query heads, per layer in Laguna, over its
    ``num_key_value_groups``). A layer that hands the cache another shape is stopped at its first
    write (``attention.py``), never decoded wrong."""
    fields = text_config.to_dict()  # not getattr: a per-layer field (Gemma 4's head_dim) raises there
    heads = getattr(module, "num_heads", None) or text_config.num_attention_heads  # per layer in Laguna
    key = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
    key = key or fields.get("head_dim") or text_config.hidden_size // heads
    value = getattr(module, "v_head_dim", None) or key
    groups = getattr(module, "num_key_value_groups", None)
    kv_heads = heads // groups if groups else getattr(module, "num_key_value_heads", None)
    kv_heads = kv_heads or fields.get("num_key_value_heads") or heads
    return int(kv_heads), int(key), int(value)


def kv_layout_of(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> KVLayout:
    """The paged cache's layout for ``model`` (checked by :func:`check_model`): each layer's K/V
    shape as its attention module declares it; a layer without one (a hybrid's recurrent or MLP
    block) holds none, ``(0, 0, 0)``: its cache tensors take no memory and index like the others."""
    base = KVLayout.from_hf_config(model.config, dtype, device)
    layers = _layers(model)
    modules = [_attention_module(layer) for layer in layers] if layers is not None else []
    if all(m is None for m in modules):
        return base
    text_config = model.config.get_text_config(decoder=True)
    shapes = tuple(_cache_shape(m, text_config) if m is not None else (0, 0, 0) for m in modules)
    uniform = len(set(shapes)) == 1 and shapes[0][1] == shapes[0][2]
    heads, key, _ = next(s for s in shapes if s[0])
    return KVLayout(len(shapes), heads, key, dtype, device, None if uniform else shapes)


def recurrent_states_for(model: torch.nn.Module, role: str, slots: int, graph_pool) -> RecurrentStates | None:
    """The state slots a runner of ``model`` needs (None: no recurrent layer). ``slots``: one per
    sequence it may run at once, plus scratch; a runner that cannot give each sequence its slot (a
    drafter LM's) is refused by name. With a ``graph_pool``, its captures keep the states of the
    slots they warm up on (:func:`slots_preserved`)."""
    mixers = recurrent_mixers(model)
    if not mixers:
        return None
    what = f"{role} family {family_of(model)!r}: its {type(mixers[0]).__name__} layers keep a recurrent state"
    if slots < 2:
        raise UnservableModel(f"{what}, which tailspec serves for the policy only, not as a drafter LM")
    states = RecurrentStates(slots)
    states.verifications_replayable = all(type(m).__name__ in ROW_VERIFIED for m in mixers)
    if graph_pool is not None:
        graph_pool.preserve = functools.partial(slots_preserved, states)
    return states
