"""The work between the front doors and the engines: dispatcher, runner, workers, queues."""
