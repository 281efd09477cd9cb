-- 0016: the size of an Attempt's output when it ended, as its Worker reported it.
--
-- A Worker that is stopping (shutdown), or whose lease ran out locally, reports the
-- ending before it has shipped all of the output, and ships the rest afterwards. A
-- reader compares the stored end of the output (attempt_output.end_offset) with this
-- size to know whether more is still coming. Written by the completing UPDATE only (a
-- terminal Attempt never changes again); NULL for a lost Attempt and when the Worker did
-- not say.

ALTER TABLE qinglong.attempts
    ADD COLUMN output_bytes bigint,
    ADD CONSTRAINT attempts_output_bytes_at_end CHECK (
        output_bytes IS NULL
        OR (finished_at_ms IS NOT NULL AND output_bytes BETWEEN 0 AND 9007199254740991)
    );
