-- Rank pinning: the CPU/memory binding the controller planned for every rank, and the binding
-- the agent read back from /proc/<pid>/status after the rank started. Lists are in the kernel's
-- list format ('0-15,64-79'); '' = not pinned (planned) or not read yet (effective).
ALTER TABLE allocations ADD COLUMN planned_cpus   TEXT NOT NULL DEFAULT ''; -- CPUs the rank is bound to
ALTER TABLE allocations ADD COLUMN planned_mems   TEXT NOT NULL DEFAULT ''; -- NUMA memory node(s) it is bound to
ALTER TABLE allocations ADD COLUMN effective_cpus TEXT NOT NULL DEFAULT ''; -- Cpus_allowed_list of the live rank
ALTER TABLE allocations ADD COLUMN effective_mems TEXT NOT NULL DEFAULT ''; -- Mems_allowed_list of the live rank (or why binding failed)
