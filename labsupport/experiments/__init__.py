"""The labs' experiments: what drives a lab's measurements and demonstrations, read last (nothing
below imports it).

Each module stands on the mechanisms (and the capstone's ``rl``) and on ``course``'s apparatus; no
chapter teaches it as a mechanism. The package docstring (``labsupport``) lists them in reading
order.
"""
