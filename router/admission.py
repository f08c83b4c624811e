"""Admission control: caps on what the router has accepted and not finished yet.

A request is counted from the moment it is admitted until its stream ends (finished, aborted,
failed or cancelled); the caps bound both the number of such requests and their prompt tokens,
so a burst of long prompts cannot queue unbounded prefill work behind the pools.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20  # prompt tokens of the admitted, unfinished requests

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}")


class Refusal(str):
    """Why a request was refused (the message) and which cap refused it (kind: requests or
    tokens)."""

    kind: str

    def __new__(cls, message: str, kind: str) -> "Refusal":
        refusal = super().__new__(cls, message)
        refusal.kind = kind
        return refusal


class Admission:
    """Counts admitted requests and their prompt tokens against AdmissionConfig's caps.

    NOTE: not thread-safe; the gRPC server calls it from its one event loop only.
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.num_requests = 0
        self.num_tokens = 0

    def try_admit(self, num_tokens: int) -> "Refusal | None":
        """Admit a request with num_tokens prompt tokens: None if admitted (counted until
        `release`), else why it was refused."""
        assert num_tokens >= 1, num_tokens
        cfg = self.config
        if num_tokens > cfg.max_queued_tokens:
            return Refusal(
                f"prompt has {num_tokens} tokens, more than the router admits in total "
                f"({cfg.max_queued_tokens} queued prompt tokens): shorten it",
                "tokens",
            )
        if self.num_requests >= cfg.max_queued_requests:
            return Refusal(
                f"too many requests in flight ({self.num_requests} of "
                f"{cfg.max_queued_requests}): retry later",
                "requests",
            )
        if self.num_tokens + num_tokens > cfg.max_queued_tokens:
            return Refusal(
                f"too many queued prompt tokens ({self.num_tokens} + {num_tokens} > "
                f"{cfg.max_queued_tokens}): retry later",
                "tokens",
            )
        self.num_requests += 1
        self.num_tokens += num_tokens
        return None

    def release(self, num_tokens: int) -> None:
        """Forget an admitted request (call exactly once per successful try_admit)."""
        assert self.num_requests >= 1 and self.num_tokens >= num_tokens, (
            self.num_requests,
            self.num_tokens,
            num_tokens,
        )
        self.num_requests -= 1
        self.num_tokens -= num_tokens
