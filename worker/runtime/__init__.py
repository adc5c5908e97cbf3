"""What keeps a worker running and visible: its settings, its event loop, the control
connection and its liveness thread, the flight recorder, stacks, timelines, the run
directory and TLS."""
