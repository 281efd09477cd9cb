-- 0033: Worker labels, and the labels a revision's Runs need (its worker_selector).
--
-- A fleet is not uniform: a Task may need a GPU, an architecture, a zone or an edge box.
-- A Worker declares labels when it opens and renews its session (its operator configures
-- them); a revision's plan may name labels its Runs need. Placement offers a Run only to a
-- session whose labels contain the Run's selector (jsonb containment: every key with
-- the same value; an empty selector is contained in any labels). The bounds are declared
-- once in the contract (rules.proto's label_key, the map rules beside each field).
--
-- The selector is part of the immutable plan, and each Run keeps a copy from the revision
-- it pins, as it keeps its executor type: the pull compares Runs with the session, never
-- joining the revision. Rows written before this migration have no selector and no labels
-- (the constant defaults), which is what they meant: any Worker, and none declared.

ALTER TABLE qinglong.task_revisions
    ADD COLUMN worker_selector jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT task_revisions_worker_selector_object
        CHECK (jsonb_typeof(worker_selector) = 'object') NOT VALID;

ALTER TABLE qinglong.runs
    ADD COLUMN worker_selector jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT runs_worker_selector_object
        CHECK (jsonb_typeof(worker_selector) = 'object') NOT VALID;

ALTER TABLE qinglong.worker_sessions
    ADD COLUMN labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT worker_sessions_labels_object
        CHECK (jsonb_typeof(labels) = 'object') NOT VALID;
-- NOT VALID: every existing row has the default, an object, so nothing needs reading (new
-- rows are checked), and a constant default rewrites no row either.
