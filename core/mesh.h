#pragma once
// Mesh: the topology a DTensor lives on, as the C++ engine sees it.
//
// The Python DeviceMesh creates the process groups; this object only records the
// facts the engine needs: the mesh shape, which global rank sits at each
// coordinate, the name of this rank's process group along each mesh dim (so that
// collectives can find it in torch's c10d registry), and this rank's coordinate.
// Meshes are interned: two meshes with the same contents are the same object, so
// "same mesh" is a pointer comparison on the per-op path.

#include <c10/core/DeviceType.h>
#include <c10/util/ArrayRef.h>

#include <memory>
#include <string>
#include <vector>

namespace vescale {

struct Mesh {
  std::vector<int64_t> shape;             // size of each mesh dim
  std::vector<int64_t> ranks;             // global rank at each coordinate, row-major
  std::vector<std::string> dim_names;     // may be empty strings
  std::vector<std::string> group_names;   // this rank's c10d group along each dim
  std::vector<int64_t> coordinate;        // this rank's coordinate
  // A c10d group over all the mesh's ranks, when one exists (the world group, for a
  // mesh over every rank): a value Partial over every dim is then reduced by one
  // all-reduce instead of one per dim. Empty when there is none.
  std::string flat_group_name;
  c10::DeviceType device_type = c10::DeviceType::CPU;

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t dim) const { return shape[static_cast<size_t>(dim)]; }
  int64_t numel() const;
  // Index of a mesh dim by name; throws with the known names when absent.
  int64_t dim_index(const std::string& name) const;
  std::string str() const;  // "DeviceMesh(cpu, [[0, 1], [2, 3]], dims=(DP, TP))"
};

using MeshPtr = std::shared_ptr<const Mesh>;

// Returns the canonical object for a mesh with these contents (validated).
MeshPtr intern_mesh(Mesh mesh);

// A mesh with no process groups, for tests and planning: `coordinate` is the
// pretend position of this process.
MeshPtr make_test_mesh(std::vector<int64_t> shape, std::vector<int64_t> coordinate);

}  // namespace vescale
