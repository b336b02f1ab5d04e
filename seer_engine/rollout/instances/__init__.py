"""Engine instances of a rollout behind one handle interface: in this process
(``local``), in a process each (``process``), or as Ray actors (``ray``)."""
