"""The phases, without Prefect: snapshot, verify, replicate, detect, rebuild, restore; the recovery's
record of an incident (``recovery``) and serving's deploy, rollout and rollback steps (``serving``).

Each phase is a plain function with keyword-only, typed inputs and a frozen, typed
result. What a phase tells the world (events, artifacts, log lines) goes through the
``Notifier`` it is handed: Prefect's in flows (``rewind.tasks.common``), a logging one
in the CLI. The Prefect tasks in ``rewind.tasks`` wrap these functions (names, retries)
and the CLI calls the same functions, so a command line and a flow do the same thing
and announce it the same way.
"""
