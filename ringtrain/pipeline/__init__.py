"""Pipeline schedules as plain data, plus their simulator, drawing and CLI."""
