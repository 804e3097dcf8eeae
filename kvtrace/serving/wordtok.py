"""A word-level tokenizer built in code, for models that ship none (kvtrace presets: random weights,
real KV geometry) so that ``transformers serve`` can serve them without a download.

One word, one token: the load test's prompt words (:data:`kvtrace.serving.phases.WORDS`) and the
chat roles have ids of their own, so a prompt of N words is N tokens and two prompts that differ in
their first word differ in their first token; every other id is a filler word "wN". The model's
own special ids (bos / eos / pad from its config) keep their meaning. A chat template renders
"role content" pairs, so /v1/chat/completions works too."""

from __future__ import annotations

from typing import Any

from kvtrace.serving.phases import WORDS

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")
UNK = "<unk>"


def _first(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and value >= 0 else None


def word_tokenizer(vocab_size: int, *, bos: Any = None, eos: Any = None, pad: Any = None) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``vocab_size`` ids (at least the words, roles and specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<s>": _first(bos), "</s>": _first(eos), "<pad>": _first(pad)}
    words: list[str | None] = [None] * vocab_size
    for name, i in specials.items():
        if i is not None and i < vocab_size and words[i] is None:
            words[i] = name
    todo = [w for w in [UNK, *(n for n, i in specials.items() if i is None), "user", "assistant", "system", *WORDS]
            if w not in words]
    free = (i for i, w in enumerate(words) if w is None)
    for w in todo:
        i = next(free, None)
        if i is None:
            raise ValueError(f"vocabulary of {vocab_size} ids is too small for the {len(todo)} words it needs")
        words[i] = w
    vocab = {w if w is not None else f"w{i}": i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {k: k for k in ("<s>", "</s>", "<pad>") if k in vocab}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, bos_token=named.get("<s>"),
                                   eos_token=named.get("</s>"), pad_token=named.get("<pad>"))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenizer_for(model: Any) -> Any:
    """:func:`word_tokenizer` sized and labelled from ``model``'s config and generation config."""
    cfg = model.config
    gen = getattr(model, "generation_config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    def pick(name: str) -> Any:
        value = getattr(gen, name, None)
        return value if value is not None else getattr(text_cfg, name, None)

    return word_tokenizer(int(text_cfg.vocab_size), bos=pick("bos_token_id"), eos=pick("eos_token_id"),
                          pad=pick("pad_token_id"))
