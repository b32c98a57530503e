"""Optional: where what a policy writes runs. Agent jails (jail.py, agent_jail.py, jail_init.py, zygote.py) for
black-box agents, and the code sandbox (pool.py, worker.py, tool_service.py) for model-written code. A run
imports this package only when its agent is a `cmd:` program or uses the code sandbox."""
