"""The in-process API: `LLM(model).generate(prompts, params)` and its streaming form."""

from collections.abc import Iterator, Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.messages import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Offline inference on one engine (EP = 1, no disaggregation): the oracle for the cluster."""

    def __init__(self, model: str = "tiny", **options: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, each with the whole output."""
        prompts = _as_list(prompts)
        results: dict[str, RequestOutput] = {}
        for delta in self.stream(prompts, params):
            if delta.request_id in results:
                results[delta.request_id].merge(delta)
            else:
                results[delta.request_id] = delta
        return [results[str(i)] for i in range(len(prompts))]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Token deltas as steps complete; request_id is the prompt's index as a string."""
        prompts = _as_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [str(i) for i in range(len(prompts))]
        engine = self.engine
        try:
            for prompt in prompts:
                engine.validate_prompt(prompt)  # fail before anything is queued
            for rid, prompt, p in zip(ids, prompts, params):
                engine.add_request(rid, prompt, p)
            while engine.has_unfinished():
                yield from engine.step().outputs
        finally:  # an error or an abandoned iterator must not leave requests holding blocks
            for rid in ids:
                engine.abort_request(rid)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # a single prompt: text or token ids
    return list(prompts)
