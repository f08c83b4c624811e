"""How one attempt at a request ends without a rank's failure: the request resumes with a new
attempt (ClusterBackend.generate), and no pool re-forms."""


class AttemptLost(RuntimeError):
    """This attempt cannot go on, and no rank is known to have failed (its KV was lost or came
    late, a work call went unanswered, a decode rank dropped this router's lease, its
    reservation was granted by a pool that failed meanwhile): the request resumes with a new
    attempt (one of max_resumes), and no pool re-forms."""


class KVTransferFailed(AttemptLost):
    """The prompt's KV did not reach the decode rank: the request resumes with a new attempt."""


class P2PTransferFailed(KVTransferFailed):
    """A point-to-point KV transfer failed: resume the request with its KV through the object
    store; `rebuild`: the transport group is broken (a timeout, a closed link), so rebuild it (a
    handle of an older group is no reason to)."""

    def __init__(self, why: str, rebuild: bool = True) -> None:
        super().__init__(why)
        self.rebuild = rebuild
