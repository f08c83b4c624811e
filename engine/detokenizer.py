"""Incremental detokenization with stop strings.

The output text grows monotonically: text already handed out is never taken back, so the tail
that could still become a stop string (or an incomplete UTF-8 character) is held back.
"""

from engine.request import Request
from engine.tokenizer import Tokenizer


def update_text(req: Request, tokenizer: Tokenizer, finished: bool) -> bool:
    """Refresh req.text after new output tokens; True if a stop string appeared (the text then
    ends right before it, and the request must stop)."""
    full = tokenizer.decode(req.output_token_ids)
    stops = req.params.stop
    if stops:
        hits = [i for i in (full.find(s, len(req.text)) for s in stops) if i >= 0]
        if hits:
            req.text = full[: min(hits)]
            return True
    if finished:
        req.text = full
        return False
    hold = max(map(len, stops)) - 1 if stops else 0
    stable = len(full.rstrip("\ufffd")) - hold
    if stable > len(req.text):
        req.text = full[:stable]
    return False
