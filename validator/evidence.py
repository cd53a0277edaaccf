"""What a verdict's digests are checked and made with, and the evidence kept for it (pure).

The gateway digests a sampled session's prompt and output ids under a random salt of that
session (schemas.audit.token_ids_digest) and hands the salt, with the ids, only to the
validator (ReplayRecord). The validator checks the ids against the event's digests, digests
the replay's ids under the same salt, and keeps the salt with both runs' ids in
MESH_VERDICTS, so whoever may read that bucket can recompute the verdict's output digests,
while a monitor, who reads only the digests, cannot confirm a guessed prompt or output.
"""

from __future__ import annotations

import hmac

from schemas.audit import DIGEST_SCHEME, ValidationEvent, token_ids_digest
from schemas.validation import ReplayRecord
from validator.compare import Run


def record_matches(event: ValidationEvent, record: ReplayRecord) -> bool:
    """Whether the gateway's record is the event's session: its ids under its salt give the
    event's digests (an event without digests, or of another scheme, matches nothing)."""
    if event.digest_scheme != DIGEST_SCHEME or event.prompt_digest is None or event.output_digest is None:
        return False
    salt = record.salt()
    return (hmac.compare_digest(token_ids_digest(record.prompt_ids, salt), event.prompt_digest)
            and hmac.compare_digest(token_ids_digest(record.output_ids, salt), event.output_digest))


def evidence(record: ReplayRecord, replay: Run | None) -> dict[str, object]:
    """A verdict's MESH_VERDICTS entry: both runs' output ids and logprobs (`replay` None: nothing
    was replayed), and the salt, with its scheme, the verdict's digests are under."""
    return {"session_id": record.session_id, "digest_scheme": DIGEST_SCHEME, "digest_salt": record.digest_salt,
            "original_ids": record.output_ids, "original_logprobs": record.output_logprobs,
            "replay_ids": list(replay.ids) if replay is not None else [],
            "replay_logprobs": list(replay.logprobs) if replay is not None else []}
