-- 0018: the projects a Worker serves.
--
-- A Worker runs its tasks as its own user: a task can read the Worker's key and inbox and
-- act as the Worker. A Worker that served every project let any project's task reach every
-- other project's Runs that way. A Worker may now be limited to some projects: placement
-- offers it only their Runs. NULL keeps the earlier meaning (every project); a list is
-- never empty. Projects are never deleted, so a listed project always exists.

ALTER TABLE qinglong.worker_identities ADD COLUMN project_ids qinglong.slug[];

-- The check reads the table once under the ALTER's lock: one row per enrolled Worker.
ALTER TABLE qinglong.worker_identities
  ADD CONSTRAINT worker_identities_project_ids_check
      CHECK (project_ids IS NULL
             OR (cardinality(project_ids) >= 1 AND array_position(project_ids, NULL) IS NULL));
