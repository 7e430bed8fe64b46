"""`modelfleet ctl`: the operator's CLI. It talks only to the control plane's admin API.

`client.py` finds the admin API and calls it, answering with the models of
`modelfleet.messages.admin`; `render.py` prints those answers as tables; `commands.py` is the
command line.

May import: the messages, security (to check a control plane's certificate) and the pure
core; never a service, the store or up (the contract "ctl talks to the admin API only").
"""
