"""One step's life on the runner: its slot and launched record (step_slot.py), the arena that stages its
input (staging.py), the per-row device tables it reads and advances (row_tables.py), carry heads
(carry.py) and image encodes (encoder_launch.py)."""
