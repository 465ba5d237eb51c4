"""The run's configuration: flag declarations, the YAML merge, validation, and the typed sections built from them.

- `flags` (+ `backend_flags`: the training-backend fields): every flag declared once, grouped like
  docs/cli-reference.md's tables;
- `arguments`: the parser, the `--custom-config-path` merge and `parse_args`;
- `validation`: the cross-flag rules and the derived values, in the tables' order;
- `batch_geometry`, `preflight`, `cli_docs`: the batch arithmetic, the checks before Ray starts, and the
  generated reference / `--dry-run` report.

Nothing below `miles.config` in the layering (`miles.utils`, the math core, the engine) imports it.
"""
