from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TextFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TEXT: _ClassVar[TextFormat]
    HTML: _ClassVar[TextFormat]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    END_OF_SENTENCE: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
TEXT: TextFormat
HTML: TextFormat
FINISH_REASON_UNSPECIFIED: FinishReason
END_OF_SENTENCE: FinishReason
LENGTH: FinishReason

class DecodingOptions(_message.Message):
    __slots__ = ("beam_size", "length_penalty", "max_length", "max_length_ratio", "max_length_offset", "min_length", "n_best", "return_scores", "no_repeat_ngram_size", "return_diagnostics", "target_prefix")
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MIN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    N_BEST_FIELD_NUMBER: _ClassVar[int]
    RETURN_SCORES_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    RETURN_DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PREFIX_FIELD_NUMBER: _ClassVar[int]
    beam_size: int
    length_penalty: float
    max_length: int
    max_length_ratio: float
    max_length_offset: int
    min_length: int
    n_best: int
    return_scores: bool
    no_repeat_ngram_size: int
    return_diagnostics: bool
    target_prefix: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, beam_size: _Optional[int] = ..., length_penalty: _Optional[float] = ..., max_length: _Optional[int] = ..., max_length_ratio: _Optional[float] = ..., max_length_offset: _Optional[int] = ..., min_length: _Optional[int] = ..., n_best: _Optional[int] = ..., return_scores: _Optional[bool] = ..., no_repeat_ngram_size: _Optional[int] = ..., return_diagnostics: _Optional[bool] = ..., target_prefix: _Optional[_Iterable[str]] = ...) -> None: ...

class TranslateRequest(_message.Message):
    __slots__ = ("texts", "source_language", "target_language", "model", "options", "as_one_sequence", "format", "stream_sentences", "priority")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    AS_ONE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    STREAM_SENTENCES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    source_language: str
    target_language: str
    model: str
    options: DecodingOptions
    as_one_sequence: bool
    format: TextFormat
    stream_sentences: bool
    priority: int
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ..., model: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., as_one_sequence: _Optional[bool] = ..., format: _Optional[_Union[TextFormat, str]] = ..., stream_sentences: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class SummarizeRequest(_message.Message):
    __slots__ = ("texts", "model", "options", "priority")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model: str
    options: DecodingOptions
    priority: int
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., options: _Optional[_Union[DecodingOptions, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class Hypothesis(_message.Message):
    __slots__ = ("text", "score", "log_prob", "tokens", "finish_reason")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LOG_PROB_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    text: str
    score: float
    log_prob: float
    tokens: int
    finish_reason: FinishReason
    def __init__(self, text: _Optional[str] = ..., score: _Optional[float] = ..., log_prob: _Optional[float] = ..., tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Diagnostics(_message.Message):
    __slots__ = ("gate", "routing_agreement")
    GATE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    gate: _containers.RepeatedScalarFieldContainer[float]
    routing_agreement: float
    def __init__(self, gate: _Optional[_Iterable[float]] = ..., routing_agreement: _Optional[float] = ...) -> None: ...

class TextResult(_message.Message):
    __slots__ = ("index", "hypotheses", "diagnostics", "source_tokens", "encoder_cache_hit", "result_cache_hit", "truncated", "sentences", "partial", "sentence")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HYPOTHESES_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSTICS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    RESULT_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SENTENCES_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SENTENCE_FIELD_NUMBER: _ClassVar[int]
    index: int
    hypotheses: _containers.RepeatedCompositeFieldContainer[Hypothesis]
    diagnostics: Diagnostics
    source_tokens: int
    encoder_cache_hit: bool
    result_cache_hit: bool
    truncated: bool
    sentences: int
    partial: bool
    sentence: int
    def __init__(self, index: _Optional[int] = ..., hypotheses: _Optional[_Iterable[_Union[Hypothesis, _Mapping]]] = ..., diagnostics: _Optional[_Union[Diagnostics, _Mapping]] = ..., source_tokens: _Optional[int] = ..., encoder_cache_hit: _Optional[bool] = ..., result_cache_hit: _Optional[bool] = ..., truncated: _Optional[bool] = ..., sentences: _Optional[int] = ..., partial: _Optional[bool] = ..., sentence: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("model", "model_version", "results", "source_language")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_version: str
    results: _containers.RepeatedCompositeFieldContainer[TextResult]
    source_language: str
    def __init__(self, model: _Optional[str] = ..., model_version: _Optional[str] = ..., results: _Optional[_Iterable[_Union[TextResult, _Mapping]]] = ..., source_language: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "task", "source_language", "target_language", "architecture", "backend", "precision", "parameters", "is_default", "max_input_pieces", "limits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_PIECES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    task: str
    source_language: str
    target_language: str
    architecture: str
    backend: str
    precision: str
    parameters: int
    is_default: bool
    max_input_pieces: int
    limits: Limits
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., task: _Optional[str] = ..., source_language: _Optional[str] = ..., target_language: _Optional[str] = ..., architecture: _Optional[str] = ..., backend: _Optional[str] = ..., precision: _Optional[str] = ..., parameters: _Optional[int] = ..., is_default: _Optional[bool] = ..., max_input_pieces: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_beam_size", "max_n_best", "max_output_tokens", "max_texts", "max_text_chars", "max_no_repeat_ngram_size")
    MAX_BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_N_BEST_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_beam_size: int
    max_n_best: int
    max_output_tokens: int
    max_texts: int
    max_text_chars: int
    max_no_repeat_ngram_size: int
    def __init__(self, max_beam_size: _Optional[int] = ..., max_n_best: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., max_texts: _Optional[int] = ..., max_text_chars: _Optional[int] = ..., max_no_repeat_ngram_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
