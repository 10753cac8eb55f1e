"""Structured output with llguidance: a request's constraint compiled once, each sequence's matcher, token masks.

Why llguidance (over xgrammar, the other engine vLLM, SGLang and llama.cpp use): it reads the tokenizer straight from
`tokenizer.json` and needs nothing else at run time (xgrammar imports transformers), it compiles any JSON schema in
milliseconds (its lexer is built lazily; xgrammar took 0.26 s to 14 s on pattern-heavy schemas here, a stall and a
denial-of-service risk for user schemas), it rejects invalid schemas and unknown formats with a message instead of
ignoring them, and it keeps added tokens out of constrained text. Its per-token mask costs more (median about 10 us,
p99 about 0.1 ms at an 8k vocabulary, against xgrammar's 2-7 us and 16-20 us), which is small beside a forward pass.

`StructuredCompiler` compiles a `StructuredOutputsParams` into an llguidance matcher, validated (a bad schema, regex
or grammar is one `DeltaspecError` sentence with llguidance's reason), cached per constraint; each sequence gets a
copy (`GrammarState`). The state gives the token mask of its next position, the masks along a draft (row i: after
the first i draft tokens, the state rolled back afterwards), the longest valid prefix of a draft, and advances over
committed tokens. End-of-sequence tokens are never fed to the matcher (llguidance miscounts them on rollback): the
mask allows them exactly where the output may end, and the engine stops there. `apply_bitmask` adds -inf to the
logits of every disallowed token (one byte-table lookup per 8 tokens, on the logits' device).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from deltaspec.errors import DeltaspecError, RequestError
from deltaspec.model.tokenizer import Tokenizer
from deltaspec.sample.params import StructuredOutputsParams

CACHE_SIZE = 64  # compiled constraints kept (each holds its lexer: megabytes for a large grammar)


def grammar_text(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(what the constraint is, for errors; llguidance's grammar text)."""
    import llguidance

    match spec:
        case StructuredOutputsParams(json=schema) if schema is not None:
            try:
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            except (ValueError, TypeError) as exc:
                raise DeltaspecError(f"The JSON schema is not valid JSON: {exc}.") from None
            return "JSON schema", text
        case StructuredOutputsParams(json_object=True):
            schema = {"type": "object"}
            return "JSON object", llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        case StructuredOutputsParams(regex=regex) if regex is not None:
            return "regex", llguidance.LLMatcher.grammar_from_regex(regex)
        case StructuredOutputsParams(choice=choice) if choice is not None:
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
            return "choice", llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        case _:
            return "grammar", llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def parser_limits():
    """llguidance's limits, its defaults but for errors that name the grammar and the parser's state (which a
    client must not see)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def reason(matcher) -> str:
    """The matcher's error on one line, without llguidance's marker of a shortened message or a trailing period."""
    return " ".join(matcher.get_error().replace("<non-verbose/>", "").split()).rstrip(".")


class GrammarState:
    """One sequence's place in its constraint."""

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int], forget: Callable[[], None] = lambda: None):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self.forget = forget  # drops the compiled constraint, whose copies share a lexer that gave out
        self.drafted = 0  # tokens a drafter moved the state past (`draft_step`), undone by `end_draft`

    def _check(self) -> None:
        """A RequestError once the matcher gave out (llguidance's lexer or parser ran past its limits): its masks
        would then allow only the end of the output, a silent wrong answer."""
        if self.matcher.is_error():
            self.forget()
            raise RequestError(
                f"The output constraint gave out while generating ({reason(self.matcher)}); simplify the JSON schema, "
                "regex, choice list or grammar."
            )

    def _masks(self, rows: int) -> np.ndarray:
        import llguidance.numpy as llgnp

        return llgnp.allocate_token_bitmask(rows, self.vocab_size)  # [rows, ceil(V / 32)] int32

    def next_mask(self) -> np.ndarray:
        """[1, ceil(V / 32)] int32: the tokens allowed next (bit t % 32 of word t // 32)."""
        import llguidance.numpy as llgnp

        masks = self._masks(1)
        llgnp.fill_next_token_bitmask(self.matcher, masks, 0)
        self._check()
        return masks

    def draft_masks(self, draft: list[int]) -> np.ndarray:
        """[len(draft) + 1, ceil(V / 32)]: row i allows the tokens that may follow the first i drafts. An
        end-of-sequence draft leaves the state as it is; the rows after a draft token the constraint refuses allow
        everything (they are never sampled from: that token is always rejected). The state is unchanged after."""
        import llguidance.numpy as llgnp

        masks = self._masks(len(draft) + 1)
        llgnp.fill_next_token_bitmask(self.matcher, masks, 0)
        consumed = 0
        for i, token in enumerate(draft):
            if token not in self.eos_ids:
                if self.matcher.try_consume_tokens([token]) != 1:
                    break
                consumed += 1
            llgnp.fill_next_token_bitmask(self.matcher, masks, i + 1)
        self._check()
        self.matcher.rollback(consumed)
        return masks

    def path_masks(self, paths: list[list[int]]) -> np.ndarray:
        """[len(paths), ceil(V / 32)]: row i allows the tokens that may follow the drafts `paths[i]` (a tree's rows:
        each row's path from the root). An end-of-sequence draft leaves the state as it is, as in `draft_masks`; a
        path stops at a token the constraint refuses (trees are pruned to what it allows first). The state is
        unchanged after."""
        import llguidance.numpy as llgnp

        masks = self._masks(len(paths))
        for i, path in enumerate(paths):
            consumed = 0
            for token in path:
                if token not in self.eos_ids:
                    if self.matcher.try_consume_tokens([token]) != 1:
                        break
                    consumed += 1
            llgnp.fill_next_token_bitmask(self.matcher, masks, i)
            self._check()
            self.matcher.rollback(consumed)
        return masks

    def draft_step(self, token: int) -> None:
        """A drafter that follows the constraint picked `token` (from `next_mask`): move past it until
        `end_draft` (an end-of-sequence token, or a token it refuses, leaves the state where it is)."""
        if token not in self.eos_ids and self.matcher.try_consume_tokens([token]) == 1:
            self.drafted += 1

    def end_draft(self) -> None:
        """Back to the committed output, before any `draft_step`."""
        if self.drafted:
            self.matcher.rollback(self.drafted)
            self.drafted = 0

    def valid_prefix(self, draft: list[int]) -> int:
        """How many leading draft tokens the constraint allows, ending before any end-of-sequence token."""
        cut = next((i for i, t in enumerate(draft) if t in self.eos_ids), len(draft))
        return self.matcher.validate_tokens(draft[:cut]) if cut else 0

    def advance(self, token: int) -> None:
        """The output grew by `token` (end-of-sequence tokens are not fed)."""
        if token in self.eos_ids:
            return
        accepted = self.matcher.consume_token(token)
        self._check()
        if not accepted:
            raise DeltaspecError(f"Token {token} left the request's constraint, which allowed only other tokens.")

    @property
    def finished(self) -> bool:
        """The constraint is complete and nothing may follow: the output ends here."""
        self._check()
        return self.matcher.is_stopped()


class StructuredCompiler:
    """Compiles constraints for one tokenizer (its llguidance tokenizer built on first use), cached; thread-safe,
    so the server can compile in a worker thread before a request reaches the engine."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._lltokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        import llguidance

        if self.tokenizer is None:
            raise DeltaspecError(
                "Structured output needs the checkpoint's tokenizer (tokenizer.json), which this model has none of."
            )
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(
                self.tokenizer.backend_json(), n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids)
            )
        return self._lltokenizer

    def cached(self, spec: StructuredOutputsParams):
        """The constraint's template matcher if it was compiled (None if not); its DeltaspecError if it failed."""
        with self._lock:
            found = self._cache.get(repr(spec))
            if found is not None:
                self._cache.move_to_end(repr(spec))
        if isinstance(found, DeltaspecError):
            raise found
        return found

    def compile(self, spec: StructuredOutputsParams):
        """The constraint's template matcher (cached); DeltaspecError naming what is wrong with it (also cached: a
        constraint that failed once fails again at once)."""
        import llguidance

        if (found := self.cached(spec)) is not None:
            return found
        with self._lock:
            lltokenizer = self._llg_tokenizer()
        try:
            kind, text = grammar_text(spec)
            matcher = llguidance.LLMatcher(lltokenizer, text, log_level=0, limits=parser_limits())
            if matcher.is_error():
                raise DeltaspecError(f"The {kind} the output is constrained to is invalid: {reason(matcher)}.")
        except DeltaspecError as exc:
            matcher = exc
        with self._lock:
            self._cache[repr(spec)] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if isinstance(matcher, DeltaspecError):
            raise matcher
        return matcher

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher of the constraint for one sequence."""
        template = self.compile(spec)
        with self._lock:
            matcher = template.deep_copy()
        return GrammarState(matcher, self.vocab_size, self.eos_ids, lambda: self.forget(spec))

    def forget(self, spec: StructuredOutputsParams) -> None:
        """Drop the compiled constraint (the next request compiles it afresh)."""
        with self._lock:
            self._cache.pop(repr(spec), None)


def mask_next(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """logits [R, V] with each row that has a constraint state masked to what that state allows next (a new tensor,
    or `logits` itself when no row is constrained)."""
    constrained = [i for i, state in enumerate(states) if state is not None]
    if not constrained:
        return logits
    rows = torch.tensor(constrained, device=logits.device)
    masks = np.concatenate([states[i].next_mask() for i in constrained])
    return logits.index_copy(0, rows, apply_bitmask(logits.index_select(0, rows), masks))


_BIT_TABLES: dict[tuple, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """logits [R, V] with -inf where row r's mask [R, ceil(V / 32)] int32 has a clear bit (a new tensor)."""
    rows, vocab = logits.shape
    key = (logits.device, logits.dtype)
    table = _BIT_TABLES.get(key)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]: bit j of byte b
        table = _BIT_TABLES[key] = torch.where(bits.bool(), 0.0, float("-inf")).to(logits.device, logits.dtype)
    packed = torch.from_numpy(np.ascontiguousarray(masks)).view(torch.uint8).to(logits.device)  # [R, 4 * words]
    return logits + table[packed.long()].view(rows, -1)[:, :vocab]
