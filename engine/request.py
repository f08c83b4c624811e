"""A request inside one engine."""

from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.messages import RequestOutput, Resume, TokenLogprobs
from engine.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # FCFS order
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose latent KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)
    num_preemptions: int = 0
    prefill_only: bool = False  # a prefill rank's request: stop after the first token
    finish_reason: str | None = None
    text: str = ""  # detokenized output, stop strings removed
    num_text_sent: int = 0
    num_tokens_sent: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Speculative decoding (engine/speculative.py): the MTP layer's drafts of the tokens after
    # the last one (d_1 .. d_k), and its hidden state [D] at the last drafted row (to chain).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_hidden: torch.Tensor | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def resume_from(self, resume: Resume) -> None:
        """Start as a request whose first tokens and text the client already has (their
        logprobs, sent before, are not kept)."""
        self.output_token_ids = list(resume.token_ids)
        self.text = resume.text
        self.num_tokens_sent, self.num_text_sent = len(self.output_token_ids), len(self.text)

    def take_delta(self) -> RequestOutput:
        """What is new since the last call (tokens and text), as a RequestOutput."""
        new_tokens = self.output_token_ids[self.num_tokens_sent :]
        new_text = self.text[self.num_text_sent :]
        new_logprobs = None
        if self.params.logprobs is not None:  # one per sampled token: the newest are the tail
            new_logprobs = self.logprobs[len(self.logprobs) - len(new_tokens) :]
        self.num_tokens_sent = len(self.output_token_ids)
        self.num_text_sent = len(self.text)
        return RequestOutput(
            self.request_id,
            new_tokens,
            new_text,
            self.finish_reason,
            len(self.prompt_token_ids),
            len(self.output_token_ids),
            self.num_cached_tokens,
            new_logprobs,
        )
