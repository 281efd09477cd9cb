-- 0013: the security audit is kept for a bounded time.
--
-- Every public call writes one audit row (SPEC R-ING-1), a Worker's polls included: a
-- fleet of a thousand Workers writes millions a day, and nothing removed them. Control's
-- reconcile cadence now removes rows older than its retention (`--audit-retention-days`,
-- default 90) through this function, a bounded page at a time.
--
-- The runtime role still has no DELETE on the audit. The function runs as the schema's
-- owner and never removes a row younger than its floor (7 days) whatever it is asked, so
-- a control process that is not what it should be cannot erase a recent call. The cutoff
-- is read from DB time once, into a variable, so the scan of the time index is bounded by
-- it; SKIP LOCKED lets control replicas share the work.

CREATE FUNCTION qinglong.prune_security_audit(p_max_age_ms bigint, p_limit integer)
    RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$
DECLARE
    -- The floor; qinglong_control.domain.audit_retention.AUDIT_RETENTION_FLOOR_MS says the
    -- same, and a contract test holds the two together.
    floor_ms CONSTANT bigint := 7 * 24 * 3600 * 1000;
    cutoff bigint;
    removed integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'the prune limit must be 1..10000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := qinglong.db_now_ms() - greatest(coalesce(p_max_age_ms, floor_ms), floor_ms);
    DELETE FROM qinglong.security_audit
     WHERE audit_id IN (
           SELECT audit_id FROM qinglong.security_audit
            WHERE occurred_at_ms < cutoff
            ORDER BY occurred_at_ms
            LIMIT p_limit
              FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END
$$;

REVOKE EXECUTE ON FUNCTION qinglong.prune_security_audit(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.prune_security_audit(bigint, integer) TO qinglong_runtime;
