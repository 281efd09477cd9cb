-- 0033: the labels a revision's Runs need from their Worker (its worker_selector).
--
-- A fleet is not uniform: a Task may need a GPU, an architecture, a zone or an edge box.
-- A revision's plan may name labels its Runs need; a Worker declares its labels with its
-- session (0035), and placement offers a Run only to a session whose labels contain the
-- Run's selector (jsonb containment: every key with the same value; an empty selector is
-- contained in any labels). The bounds are declared once in the contract (rules.proto's
-- label_key, the map rules beside each field); ingress and control enforce them.
--
-- 0033-0035 alter one table each, so that no migration holds one of these tables while it
-- waits for another (the runtime locks sessions, then Runs, then reads revisions: a
-- migration holding several in another order could deadlock with it).

ALTER TABLE qinglong.task_revisions
    ADD COLUMN worker_selector jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT task_revisions_worker_selector_object
        CHECK (jsonb_typeof(worker_selector) = 'object') NOT VALID;
-- NOT VALID: every existing row has the default, an object, so nothing needs reading (new
-- rows are checked), and a constant default rewrites no row either. Revisions written
-- before this migration have no selector, which is what they meant: any Worker.
