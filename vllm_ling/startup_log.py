"""The plugin's start-up lines, each defined once: the plugin logs `LINE.text(...)` and the self-check
(`ling_tools.selfcheck`) reads it back with `LINE.search(log)`, a pattern built from the same template, so the
sentence and its reading cannot drift apart.

Standard library only: the self-check imports this module without vLLM or torch.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Line:
    """A log line with named fields: `template` in str.format syntax, `fields` the pattern each field matches."""

    template: str
    fields: dict[str, str]
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = []
        for literal, name, _spec, _conv in string.Formatter().parse(self.template):
            parts.append(re.escape(literal))
            if name is not None:
                parts.append(f"(?P<{name}>{self.fields[name]})")
        object.__setattr__(self, "pattern", re.compile("".join(parts)))

    def text(self, **values: Any) -> str:
        return self.template.format(**values)

    def search(self, log: str) -> dict[str, str] | None:
        """The fields of the first such line in `log`, or None."""
        found = self.pattern.search(log)
        return found.groupdict() if found else None

    def findall(self, log: str) -> list[dict[str, str]]:
        return [m.groupdict() for m in self.pattern.finditer(log)]


INTREE = "vLLM's in-tree implementation"  # REGISTERED's `who` when vLLM's own model serves

# vllm_ling.plugin, once per process: which implementation serves and why.
REGISTERED = Line("vllm-ling: {arch} and its MTP draft are served by {who} on vLLM {version} ({why}; "
                  "{env}=vllm-ling|vllm picks).",
                  dict(arch=r"\w+", who=r".+?", version=r"\S+", why=r".+", env=r"\w+"))
REGISTRATION_FAILED = Line("vllm-ling: registration failed ({error}); vLLM serves its in-tree model, if it has one. "
                           "See README 'Which implementation serves'.", dict(error=r".+?"))
# vllm_ling.fp8, once the LM head got its method (the target's line first, then the MTP draft's).
FP8_ON = Line("vllm-ling: FP8 weights ON ({linears} linears{head}), {kernel}, {scheme} scales",
              dict(linears=r"\d+", head=r" \+ LM head|, LM head BF16", kernel=r"\w+", scheme=r"\w+"))
FP8_HEAD_ON, FP8_HEAD_BF16 = " + LM head", ", LM head BF16"
# vllm_ling.draft.dspark, once the DSpark drafter is built with its own quantization ling_fp8 (vllm_ling.fp8).
DSPARK_FP8_ON = Line("vllm-ling: DSpark drafter FP8 weights ON ({linears} linears{markov}), {kernel}, {scheme} scales",
                     dict(linears=r"\d+", markov=r" \+ Markov head|, Markov head BF16", kernel=r"\w+",
                          scheme=r"\w+"))
DSPARK_MARKOV_ON, DSPARK_MARKOV_BF16 = " + Markov head", ", Markov head BF16"
# vllm_ling.kda: the gate runs inside vLLM's raw-gate KDA kernels; vllm_ling.kda_core: it fell back to ours.
KDA_GATE_IN_KERNEL = Line("vllm-ling: KDA gate and β inside vLLM's KDA kernels ({env}=kernel)", dict(env=r"\w+"))
KDA_GATE_FELL_BACK = Line("vllm-ling: KDA gate fell back to ours: {reason}", dict(reason=r".+"))
# vllm_ling.kda, once per process: the kernel of KDA prefills and why (vllm_ling.flashkda.choose).
KDA_PREFILL_KERNELS = ("FlashKDA", "Triton chunk_kda", "torch chunk_kda")
KDA_PREFILL = Line("vllm-ling: KDA prefill on {kernel} ({why})",
                   dict(kernel="|".join(map(re.escape, KDA_PREFILL_KERNELS)), why=r".+"))
# vllm_ling.kda, once: KDA layers declare in-prefill checkpoints (VLLM_LING_KDA_PREFILL_CHECKPOINT, on unless 0), or
# cannot (no prefix cache, a Triton prefill).
KDA_CHECKPOINT = Line("vllm-ling: KDA in-prefill checkpoints {state} ({why})", dict(state="ON|OFF", why=r".+"))
# vllm_ling.draft.vocab, once the draft gathered its head rows.
DRAFT_VOCAB = Line("vllm-ling: MTP draft proposes among {ids} of {vocab} tokens ({env}; {mib:.0f} MiB of head rows, "
                   "{dtype})", dict(ids=r"\d+", vocab=r"\d+", env=r"\w+", mib=r"\d+", dtype=r"\S+"))

LINES = (REGISTERED, REGISTRATION_FAILED, FP8_ON, DSPARK_FP8_ON, KDA_GATE_IN_KERNEL, KDA_GATE_FELL_BACK,
         KDA_PREFILL, KDA_CHECKPOINT, DRAFT_VOCAB)
