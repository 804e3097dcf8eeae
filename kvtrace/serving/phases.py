"""The four-phase protocol of the KV-cache diagnosis (seed document 001, "The Diagnostic Steps"):

1. ``baseline``: no requests for a while (the server's memory at rest);
2. ``single``: one request (growth by one request's KV, and its release);
3. ``concurrent``: N requests at once, L prompt tokens each (default 10 x 2,048);
4. ``long``: one long-context request (default 16,384 prompt tokens).

Prompts are made of common English words, one token each in the usual BPE vocabularies (" the",
" of", ...), so L words are about L tokens; the latency table keeps the server's own count when it
reports usage. Each request's words start at a different place of the list, so no two prompts share
a prefix: prefix caching cannot hide the KV of concurrent requests."""

from __future__ import annotations

from dataclasses import dataclass

PHASES = ("baseline", "single", "concurrent", "long")
# the phase whose one long request is the planted probe: kvtrace analyze's context_spike reports a
# spike admitted in it as the probe (context_spike.PROBE_PHASES names it; a test keeps them equal)
LONG_PROBE = "long"
END_MARKER = "end"  # the marker posted after the last phase, closing its window in the trace

WORDS = ("the of and to in is it that for on was with as be at by this had not are but from or have an they "
         "which one you were all her she there would their we him been has when who will no more if out so "
         "said what up its about than into them can only other new some could time these two may then do "
         "first any my now such like our over man me even most made after also did many before must "
         "through back years where much your way well down should because each just those people how too "
         "little state good very make world still own see men work long get here between both life being "
         "under never day same another know while last might us great old year off come since against go "
         "came right used take three").split()


@dataclass(frozen=True)
class Phase:
    name: str
    requests: int  # requests sent (0: idle)
    concurrency: int  # sent at once
    prompt_tokens: int  # words per prompt (about one token each)
    idle_s: float = 0.0  # baseline: how long to stay idle


def build_phases(names: list[str], *, concurrency: int, tokens: int, long_tokens: int,
                 baseline_s: float) -> list[Phase]:
    """The phases asked for, in protocol order whatever order they were named in."""
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    table = {
        "baseline": Phase("baseline", 0, 0, 0, baseline_s),
        "single": Phase("single", 1, 1, tokens),
        "concurrent": Phase("concurrent", concurrency, concurrency, tokens),
        "long": Phase("long", 1, 1, long_tokens),
    }
    return [table[n] for n in PHASES if n in names]


def prompt(n_words: int, seed: int) -> str:
    """``n_words`` words from :data:`WORDS`, starting at a place that depends on ``seed``."""
    start = (seed * 7919) % len(WORDS)
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(max(1, n_words)))
