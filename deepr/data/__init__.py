"""Data construction: evidence trees (`build-trees`), query-rubric pairs (`synthesize-rubrics`)
and their audit (`verify`). Modules: topics → trees (+ tree_roles) → rubrics (+ rubric_checks)
→ verify (+ verify_checks)."""
