-- 0011: a session's live Attempts, found without reading the others.
--
-- PullOffers (placement.lock_candidates) and ClaimOffer (placement.session_room) count the
-- calling session's live Attempts to know its room. Without an index on session_id that
-- count read every Attempt row: 18 ms per poll with 100,000 Attempts running across the
-- fleet (bench/bench_scale.py --explain), growing with the fleet. This partial index holds
-- only live Attempts, so the count costs the session's own few entries.

CREATE INDEX attempts_live_by_session ON qinglong.attempts (session_id)
    WHERE state IN ('claimed', 'starting', 'running');
