"""`overworld run`: every service of a run as a supervised child process on this machine.

| module | what |
|---|---|
| `run.py` | the run loop: prepare the workdir, start, follow the run to its end, stop, write the summary |
| `supervisor.py` | starting the services, waiting for their health, restarting those that exit, stopping them all |
| `credentials.py` | the run's throwaway CA, a certificate per identity, the Ray token |
| `processes.py` | the processes below a service (`/proc`): what a dead service left behind is killed |
| `service_logs.py` | what a service's log says: its last lines, the one record of a refused start |
| `progress.py` | the progress line against the run's budget (total, percent, time left) |
| `curve.py` | a learning-curve point (`progress.jsonl`) and the summary's figures per task |
| `milestones.py` | when the run reached each step of its start (the structured startup timeline) |
"""
