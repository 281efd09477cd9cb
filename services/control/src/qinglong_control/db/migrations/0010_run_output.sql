-- 0010: Run output (R-OPS-1): the executor output Workers ship, kept per Attempt.
--
-- A Worker appends an Attempt's output in chunks of at most 64 KiB at byte offsets
-- (WorkerService.AppendOutput); operators read it back by offset (RunService.
-- ReadRunOutput). One `attempt_output` row per Attempt holds where the stream stands:
-- `end_offset`, the bytes received so far (the next chunk's offset; it never moves back,
-- so a re-sent chunk is recognised as a replay), and `first_offset`, the first byte still
-- kept. The chunks themselves are contiguous rows of `attempt_output_chunks`.
--
-- Retention (docs/protocol.md "Run output") deletes chunks, never a stream row: the
-- oldest chunks of an Attempt beyond the size bound when a chunk is appended, and all of
-- an Attempt's chunks once its output has not been written for the retention age (the
-- reconcile cadence; `attempt_output_retained` finds those cheaply). The runtime role may
-- therefore DELETE chunks, and nothing else anywhere.

CREATE TABLE qinglong.attempt_output (
    attempt_id     uuid PRIMARY KEY REFERENCES qinglong.attempts (attempt_id),
    end_offset     bigint NOT NULL CHECK (end_offset BETWEEN 1 AND 9007199254740991),
    first_offset   bigint NOT NULL CHECK (first_offset >= 0),
    created_at_ms  qinglong.epoch_ms NOT NULL,
    updated_at_ms  qinglong.epoch_ms NOT NULL,
    CHECK (first_offset <= end_offset)
);

CREATE INDEX attempt_output_retained
    ON qinglong.attempt_output (updated_at_ms) WHERE first_offset < end_offset;

CREATE TABLE qinglong.attempt_output_chunks (
    attempt_id    uuid NOT NULL REFERENCES qinglong.attempt_output (attempt_id),
    start_offset  bigint NOT NULL CHECK (start_offset >= 0),
    end_offset    bigint NOT NULL,
    data          bytea NOT NULL CHECK (octet_length(data) BETWEEN 1 AND 65536),
    PRIMARY KEY (attempt_id, start_offset),
    CHECK (end_offset = start_offset + octet_length(data))
);

GRANT SELECT, INSERT, UPDATE ON qinglong.attempt_output TO qinglong_runtime;
GRANT SELECT, INSERT, DELETE ON qinglong.attempt_output_chunks TO qinglong_runtime;
