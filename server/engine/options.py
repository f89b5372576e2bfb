"""Per-request decoding options and the server's limits on them.

Every field has a default; `check` raises OptionError (-> INVALID_ARGUMENT) naming the field,
the value and the allowed range, so a client can fix its request from the message alone."""
from __future__ import annotations

from dataclasses import dataclass

from training.seq2seq.beam import output_limit


class OptionError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    max_beam: int = 16
    max_n_best: int = 16
    max_output_tokens: int = 256  # also bounded by the model's position table
    max_texts: int = 256  # per call
    max_text_chars: int = 4000  # per text; longer texts are refused, never truncated silently
    max_no_repeat_ngram: int = 8


@dataclass(frozen=True)
class DecodingOptions:
    beam: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.5  # output length limit = a * source pieces + b ...
    max_len_b: int = 10
    max_length: int = 0  # ... and at most this many tokens (0: no absolute limit)
    min_length: int = 0  # EOS is forbidden before this many tokens
    n_best: int = 1
    no_repeat_ngram: int = 0  # 0: off; n: no n-gram occurs twice in an output
    return_scores: bool = False
    diagnostics: bool = False  # GRET: mean context-gate value per token, routing agreement
    # target pieces the output begins with (forced, then free search: training.seq2seq.beam.force_prefix);
    # set per sequence by the pipeline from the request's target_prefix text, checked by output_limit
    prefix: tuple[int, ...] = ()

    def check(self, limits: Limits) -> "DecodingOptions":
        def require(ok: bool, field: str, value, allowed: str):
            if not ok:
                raise OptionError(f"option {field}={value} is out of range: {allowed}")

        require(1 <= self.beam <= limits.max_beam, "beam_size", self.beam, f"1..{limits.max_beam}")
        require(1 <= self.n_best <= min(self.beam, limits.max_n_best), "n_best", self.n_best,
                f"1..beam_size ({self.beam})")
        require(0.0 <= self.length_penalty <= 10.0, "length_penalty", self.length_penalty, "0..10")
        require(0.0 <= self.max_len_a <= 10.0, "max_length_ratio", self.max_len_a, "0..10")
        # the ratio and offset only shape the limit; output_limit caps it at max_output_tokens
        require(0 <= self.max_len_b <= 10_000, "max_length_offset", self.max_len_b, "0..10000")
        require(0 <= self.max_length <= limits.max_output_tokens, "max_length", self.max_length,
                f"0..{limits.max_output_tokens} (0 = no absolute limit)")
        # min_length is checked per text, against that text's output limit (output_limit)
        require(0 <= self.no_repeat_ngram <= limits.max_no_repeat_ngram, "no_repeat_ngram_size",
                self.no_repeat_ngram, f"0..{limits.max_no_repeat_ngram} (0 = off)")
        return self

    def output_limit(self, source_tokens: int, model_limit: int, limits: Limits) -> int:
        """Most tokens the search may generate for a source of this many pieces (EOS counted):
        training.seq2seq.beam.output_limit's a * n + b, at most max_length (if set), the model's limit
        and the server's. A min_length above it is an OptionError: the search would stop at the
        limit with no end of sentence; so is a prefix that leaves no room for a token of the search's
        own (it would be the whole output, one hypothesis whatever n_best asks)."""
        cap = min(c for c in (self.max_length, model_limit, limits.max_output_tokens) if c)
        n = output_limit(source_tokens, self.max_len_a, self.max_len_b, cap)
        if len(self.prefix) >= n:
            raise OptionError(f"option target_prefix is {len(self.prefix)} pieces, not shorter than the output limit "
                              f"of {n} tokens for this text ({source_tokens} source tokens; the end of sentence "
                              f"counts): shorten it, or raise max_length_ratio, max_length_offset or max_length "
                              f"(at most {min(model_limit, limits.max_output_tokens)})")
        if self.min_length > n:
            raise OptionError(f"option min_length={self.min_length} is above the output limit of {n} tokens for "
                              f"this text ({source_tokens} source tokens): lower min_length, or raise "
                              f"max_length_ratio, max_length_offset or max_length (at most "
                              f"{min(model_limit, limits.max_output_tokens)})")
        return n
