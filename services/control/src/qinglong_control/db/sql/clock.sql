-- DB time: the only clock of durable facts.

-- name: db_now
-- Epoch milliseconds from the database's clock. Commands read it after their locks
-- (qinglong.db_now_ms() uses clock_timestamp(), not the frozen transaction start).
SELECT qinglong.db_now_ms()
