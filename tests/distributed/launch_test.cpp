#include "dalle/distributed/launch.h"

#include <map>

#include "test_support.h"

namespace dalle::distributed {
namespace {

// An environment of the given variables only.
Environment only(std::map<std::string, std::string> variables) {
  return [variables = std::move(variables)](const std::string& name) -> std::optional<std::string> {
    const auto found = variables.find(name);
    return found == variables.end() ? std::nullopt : std::optional<std::string>(found->second);
  };
}

TEST(LaunchEnvironment, NoLauncherIsAJobOfOne) {
  const auto job = read_launch_environment(only({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}}));
  EXPECT_EQ(job.launcher, "none") << "a batch script's own process is not a rank";
  EXPECT_EQ(job.world_size, 1);
  EXPECT_EQ(job.rank, 0);
  EXPECT_EQ(job.master_addr, "127.0.0.1");
}

TEST(LaunchEnvironment, TorchrunComesFirstWithItsAgentStoreAndRestarts) {
  const auto job = read_launch_environment(only({{"RANK", "5"},
                                                {"WORLD_SIZE", "8"},
                                                {"LOCAL_RANK", "1"},
                                                {"LOCAL_WORLD_SIZE", "4"},
                                                {"GROUP_RANK", "1"},
                                                {"MASTER_ADDR", "10.0.0.2"},
                                                {"MASTER_PORT", "29400"},
                                                {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                                {"TORCHELASTIC_RESTART_COUNT", "2"},
                                                {"OMPI_COMM_WORLD_RANK", "0"},
                                                {"OMPI_COMM_WORLD_SIZE", "1"}}));
  EXPECT_EQ(job.launcher, "torchrun");
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.local_rank, 1);
  EXPECT_EQ(job.node_rank, 1);
  EXPECT_EQ(job.nodes, 2);
  EXPECT_EQ(job.master_addr, "10.0.0.2");
  EXPECT_EQ(job.master_port, 29400);
  EXPECT_TRUE(job.agent_store);
  EXPECT_EQ(job.restart_count, 2);
}

TEST(LaunchEnvironment, MpirunIsReadAsALauncherAndNeedsAMasterAcrossMachines) {
  std::map<std::string, std::string> one_machine = {{"OMPI_COMM_WORLD_RANK", "3"},
                                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "3"},
                                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
  const auto job = read_launch_environment(only(one_machine));
  EXPECT_EQ(job.launcher, "mpirun");
  EXPECT_EQ(job.rank, 3);
  EXPECT_EQ(job.nodes, 1);
  EXPECT_EQ(job.master_addr, "127.0.0.1");
  auto two_machines = one_machine;
  two_machines["OMPI_COMM_WORLD_SIZE"] = "8";
  two_machines["OMPI_COMM_WORLD_NODE_RANK"] = "0";
  EXPECT_THROW_WITH(read_launch_environment(only(two_machines)), Error, "across 2 machines", "MASTER_ADDR");
  two_machines["MASTER_ADDR"] = "host0";
  EXPECT_EQ(read_launch_environment(only(two_machines)).master_addr, "host0");
  // NODE_RANK is Open MPI's rank within the machine; the machine follows from the mapping.
  two_machines["OMPI_COMM_WORLD_RANK"] = "6";
  two_machines["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";
  two_machines["OMPI_COMM_WORLD_NODE_RANK"] = "2";
  EXPECT_EQ(read_launch_environment(only(two_machines)).node_rank, 1);
}

TEST(LaunchEnvironment, SrunTakesTheMasterFromTheNodeList) {
  const auto job = read_launch_environment(only({{"SLURM_PROCID", "6"},
                                                {"SLURM_STEP_ID", "0"},
                                                {"SLURM_NTASKS", "8"},
                                                {"SLURM_LOCALID", "2"},
                                                {"SLURM_NODEID", "1"},
                                                {"SLURM_NNODES", "2"},
                                                {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                                {"SLURM_JOB_NODELIST", "gpu[07-08]"}}));
  EXPECT_EQ(job.launcher, "slurm");
  EXPECT_EQ(job.rank, 6);
  EXPECT_EQ(job.local_world_size, 4);
  EXPECT_EQ(job.node_rank, 1);
  EXPECT_EQ(job.master_addr, "gpu07");
  EXPECT_EQ(job.master_port, 29500);
}

TEST(LaunchEnvironment, SlurmListsAreExpandedAsScontrolWould) {
  EXPECT_EQ(first_slurm_host("gpu[07-09,12],cpu1"), "gpu07");
  EXPECT_EQ(first_slurm_host("cpu1,cpu2"), "cpu1");
  EXPECT_EQ(first_slurm_host("rack[2-3]-node[001-004]"), "rack2-node001");
  EXPECT_THROW_WITH(first_slurm_host("gpu[07"), Error, "unclosed");
  EXPECT_EQ(slurm_tasks_per_node("4(x2),3"), (std::vector<int64_t>{4, 4, 3}));
  EXPECT_EQ(slurm_tasks_per_node("8"), (std::vector<int64_t>{8}));
  EXPECT_THROW_WITH(slurm_tasks_per_node("4(x2"), Error, "SLURM_TASKS_PER_NODE", "N(xK)");
}

TEST(LaunchEnvironment, MalformedOrInconsistentVariablesNameWhatIsWrong) {
  std::map<std::string, std::string> torchrun = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}};
  auto bad = torchrun;
  bad["RANK"] = "-1";
  EXPECT_THROW_WITH(read_launch_environment(only(bad)), Error, "RANK='-1': expected a non-negative integer");
  bad = torchrun;
  bad["RANK"] = "2";
  EXPECT_THROW_WITH(read_launch_environment(only(bad)), Error, "torchrun's variables disagree", "rank 2 of a world of 2");
  bad = torchrun;
  bad.erase("LOCAL_RANK");
  EXPECT_THROW_WITH(read_launch_environment(only(bad)), Error, "LOCAL_RANK is not set");
  bad = torchrun;
  bad["MASTER_PORT"] = "70000";
  EXPECT_THROW_WITH(read_launch_environment(only(bad)), Error, "MASTER_PORT 70000");
  bad = torchrun;
  bad["WORLD_SIZE"] = "3";
  EXPECT_THROW_WITH(read_launch_environment(only(bad)), Error, "run as many on every machine");
}

}  // namespace
}  // namespace dalle::distributed
