#include "core/mesh.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <numeric>
#include <sstream>

namespace vescale {

int64_t Mesh::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

int64_t Mesh::dim_index(const std::string& name) const {
  for (size_t i = 0; i < dim_names.size(); ++i)
    if (dim_names[i] == name) return static_cast<int64_t>(i);
  std::ostringstream known;
  for (size_t i = 0; i < dim_names.size(); ++i) known << (i ? ", " : "") << dim_names[i];
  TORCH_CHECK_VALUE(false, "mesh has no dimension named '", name, "'; its dimensions are (",
                    known.str(), ")");
}

namespace {

void print_nested(std::ostringstream& os, const Mesh& m, size_t dim, size_t& pos) {
  if (dim == m.shape.size()) {
    os << m.ranks[pos++];
    return;
  }
  os << "[";
  for (int64_t i = 0; i < m.shape[dim]; ++i) {
    if (i) os << ", ";
    print_nested(os, m, dim + 1, pos);
  }
  os << "]";
}

bool same_contents(const Mesh& a, const Mesh& b) {
  return a.shape == b.shape && a.ranks == b.ranks && a.dim_names == b.dim_names &&
      a.group_names == b.group_names && a.coordinate == b.coordinate &&
      a.device_type == b.device_type && a.flat_group_name == b.flat_group_name;
}

}  // namespace

std::string Mesh::str() const {
  std::ostringstream os;
  os << "DeviceMesh(" << c10::DeviceTypeName(device_type, /*lower_case=*/true) << ", ";
  size_t pos = 0;
  print_nested(os, *this, 0, pos);
  bool named = false;
  for (const auto& n : dim_names) named |= !n.empty();
  if (named) {
    os << ", dims=(";
    for (size_t i = 0; i < dim_names.size(); ++i) os << (i ? ", " : "") << dim_names[i];
    os << ")";
  }
  os << ")";
  return os.str();
}

MeshPtr intern_mesh(Mesh mesh) {
  TORCH_CHECK_VALUE(!mesh.shape.empty(), "a device mesh needs at least one dimension");
  for (auto s : mesh.shape) TORCH_CHECK_VALUE(s > 0, "mesh dimensions must be positive");
  TORCH_CHECK_VALUE(static_cast<int64_t>(mesh.ranks.size()) == mesh.numel(),
                    "mesh has ", mesh.ranks.size(), " ranks but its shape holds ", mesh.numel());
  TORCH_CHECK_VALUE(mesh.coordinate.size() == mesh.shape.size(),
                    "this rank's mesh coordinate must have one entry per mesh dim");
  if (mesh.dim_names.empty()) mesh.dim_names.resize(mesh.shape.size());
  if (mesh.group_names.empty()) mesh.group_names.resize(mesh.shape.size());
  TORCH_CHECK_VALUE(mesh.dim_names.size() == mesh.shape.size() &&
                        mesh.group_names.size() == mesh.shape.size(),
                    "mesh dim names and group names need one entry per mesh dim");

  // Few meshes exist in a program; a linear scan keeps this simple.
  static std::mutex mu;
  static std::vector<MeshPtr> meshes;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& m : meshes)
    if (same_contents(*m, mesh)) return m;
  meshes.push_back(std::make_shared<const Mesh>(std::move(mesh)));
  return meshes.back();
}

MeshPtr make_test_mesh(std::vector<int64_t> shape, std::vector<int64_t> coordinate) {
  Mesh m;
  m.ranks.resize(static_cast<size_t>(
      std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>())));
  std::iota(m.ranks.begin(), m.ranks.end(), 0);
  m.shape = std::move(shape);
  m.coordinate = std::move(coordinate);
  return intern_mesh(std::move(m));
}

}  // namespace vescale
