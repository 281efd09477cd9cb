-- 0021: IssueJoinToken's request id, kept on the join token it issued.
--
-- A retried IssueJoinToken (the same request id for the same Worker) is answered from
-- the token the first call issued: its expiry, never its secret (only its digest is
-- stored). The join token CreateWorker made has none, which is how a retried
-- CreateWorker finds it. The request id is fixed with the rest of the row once it is
-- used (the single-use trigger, restated with the new column).
--
-- NOT VALID: the CHECK holds for every row written from now on without reading the
-- existing ones (all NULL) under a lock that would stop joins.

ALTER TABLE qinglong.worker_join_tokens
    ADD COLUMN issue_request_id text,
    ADD CONSTRAINT worker_join_tokens_issue_request_id_shape
        CHECK (issue_request_id ~ '^[A-Za-z0-9._:-]{1,64}$') NOT VALID;

CREATE UNIQUE INDEX worker_join_tokens_by_issue_request
    ON qinglong.worker_join_tokens (worker_id, issue_request_id)
 WHERE issue_request_id IS NOT NULL;

CREATE OR REPLACE FUNCTION qinglong.enforce_join_token_single_use() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.used_at_ms IS NOT NULL
       OR (NEW.token_digest, NEW.worker_id, NEW.created_at_ms, NEW.expires_at_ms,
           NEW.issue_request_id)
          IS DISTINCT FROM
          (OLD.token_digest, OLD.worker_id, OLD.created_at_ms, OLD.expires_at_ms,
           OLD.issue_request_id) THEN
        RAISE EXCEPTION 'join token of worker % is used or fixed', OLD.worker_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'worker_join_tokens_single_use';
    END IF;
    RETURN NEW;
END
$$;
