"""What one engine step carries between the runner, Bole's layers and the drafter: the packed forest of draft trees
(:mod:`.forest`) and the copies of device results to the host (:mod:`.host_copy`). Imports only the kernels."""
