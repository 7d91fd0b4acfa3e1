"""Before init_distributed, `config` answers as BMTrain's does for one process."""

import nbtrain as nbt


def test_config_before_init_is_one_uninitialised_rank():
    assert not nbt.comm.is_initialized()
    assert nbt.config["initialized"] is False
    assert (nbt.config["rank"], nbt.config["local_rank"], nbt.config["world_size"]) == (0, 0, 1)
