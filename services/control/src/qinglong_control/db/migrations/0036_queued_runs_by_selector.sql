-- qinglong: outside-transaction
-- 0036: the queue in two parts, the Runs any Worker may take and those with a selector.
--
-- A Worker of every project read the whole queue by age (runs_queued_by_age), filtering
-- each Run by its selector (0034): every pull read past every older queued Run its labels
-- did not satisfy, and a Run no Worker matches waits for ever. Anyone who may trigger Runs
-- could thus slow every such Worker's pulls, each tick, by queueing Runs that need a label
-- nobody has. Its pull now reads the Runs without a selector from their own index, and
-- only a session that declared labels reads the Runs with one (and pays for those it
-- cannot take). runs_queued_by_age stays: control replicas of the earlier version read
-- the queue through it until a rolling upgrade has replaced them (a later migration may
-- drop it).
--
-- Built CONCURRENTLY, outside a transaction (as in 0020): a plain CREATE INDEX would stop
-- every write to runs for as long as it reads the table. Each index is dropped first, so
-- a migrator that stopped half-way, leaving an invalid index, is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_for_any_worker;
CREATE INDEX CONCURRENTLY runs_queued_for_any_worker
    ON qinglong.runs (created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector = '{}'::jsonb;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_with_selector;
CREATE INDEX CONCURRENTLY runs_queued_with_selector
    ON qinglong.runs (created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector <> '{}'::jsonb;
