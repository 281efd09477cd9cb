-- 0008: ListTasks reads a project's Tasks newest first, a page at a time.
--
-- definitions.list_tasks orders by (created_at_ms, task_id) DESC within a project and
-- resumes after the last row of the previous page; read backward, this index serves both
-- the order and the page token's comparison, so a page costs its rows, not the project's.

CREATE INDEX tasks_by_project ON qinglong.tasks (project_id, created_at_ms, task_id);
