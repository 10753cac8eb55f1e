"""When a sequence stops: eos, stop token ids, stop strings (matched on the decoded text and cut there),
a structured-output constraint that is complete with nothing to follow, max_tokens and the context length —
checked after each appended token (which first advances the sequence's constraint)."""

from __future__ import annotations

from deltaspec.execution.sequence import Sequence
from deltaspec.model.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def __call__(self, seq: Sequence, token: int) -> bool:
        """Whether `seq` stops at `token`, its newest output token; sets its finish and stop reasons."""
        params = seq.request.params
        n = len(seq.output_ids)
        if seq.request.grammar is not None:
            seq.request.grammar.advance(token)
            if seq.request.grammar.finished and token not in seq.request.eos_ids:
                seq.finish_reason = "stop"
                return True
        if n >= params.min_tokens:
            if not params.ignore_eos and token in seq.request.eos_ids:
                seq.finish_reason = "stop"
                return True
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                if not params.include_stop_str_in_output and self.tokenizer is not None:
                    seq.stop_text = self.tokenizer.decode(seq.output_ids[:-1], params.skip_special_tokens)
                return True
            if params.stop and self.tokenizer is not None and self._match_stop_string(seq):
                return True
        if n >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _match_stop_string(self, seq: Sequence) -> bool:
        """Look for a stop string in the text of the last few tokens only (any earlier match would have
        stopped the sequence already); on a match, cut the full text once."""
        params = seq.request.params
        longest = max(len(s) for s in params.stop)
        tail = self.tokenizer.decode(seq.output_ids[-(2 * longest + 8) :], params.skip_special_tokens)
        if not any(stop in tail for stop in params.stop):
            return False
        text = self.tokenizer.decode(seq.output_ids, params.skip_special_tokens)
        matches = [(text.find(s), s) for s in params.stop if s in text]
        if not matches:
            return False
        at, stop = min(matches)
        end = at + len(stop) if params.include_stop_str_in_output else at
        seq.finish_reason, seq.stop_reason, seq.stop_text = "stop", stop, text[:end]
        return True
