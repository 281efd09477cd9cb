"""qinglong_worker: the Worker library and daemon.

One module per job:

* :mod:`~qinglong_worker.inbox` — the durable local inbox (SQLite, compare-and-set);
* :mod:`~qinglong_worker.process` — the local process controller (PID + start time);
* :mod:`~qinglong_worker.client` — the one mTLS channel to ingress, typed calls;
* :mod:`~qinglong_worker.session` — open, renew and resume the Worker session;
* :mod:`~qinglong_worker.reconcile` — ``reconcile(offer_id)`` and the start path;
* :mod:`~qinglong_worker.lifecycle` — the headless tick loop (supervise, then pull);
* :mod:`~qinglong_worker.supervisor` — the executor's supervisor (keeps its exit status);
* :mod:`~qinglong_worker.daemon` — ``qinglong-worker run``: wiring, signals, exit status;
* :mod:`~qinglong_worker.main` — ``qinglong-worker check|run``.
"""
