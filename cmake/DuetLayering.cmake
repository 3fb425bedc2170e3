# The library layering, checked at configure time: every Duet library has a layer, and a
# library may link only libraries of lower layers. So the target graph has no cycle, and a
# link that goes sideways or up (the engine linking a backend, say) fails the configure step.
# A new library gets a layer here.
set(DUET_LAYERS
  "duet_common duet_proto duet_kernels duet_test_process duet_test_certs"  # 0: leaves
  "duet_tokenizer duet_chat_template duet_model duet_kv_cache duet_kvtransfer duet_metrics duet_parallel duet_grammar"  # 1
  "duet_engine duet_parallel_nccl"                                      # 2: the engine loop; the NCCL communicator
  "duet_cpu_backend duet_cuda_backend"                                  # 3: ModelExecutor implementations
  "duet_backends"                                                       # 4: the one place that knows them all
  "duet_rpc duet_worker duet_local_cluster duet_bench_serving"          # 5
  "duet_prefill_worker duet_decode_worker duet_router duet_worker_process"  # 6: the roles, and the process both workers run
  "duet_cli")                                                           # 7: the `duet` command

function(duet_check_layering)
  set(rank 0)
  foreach(layer IN LISTS DUET_LAYERS)
    separate_arguments(names UNIX_COMMAND "${layer}")
    foreach(name IN LISTS names)
      set(layer_of_${name} ${rank})
    endforeach()
    math(EXPR rank "${rank} + 1")
  endforeach()

  set(pending ${CMAKE_SOURCE_DIR})
  set(libraries)
  while(pending)
    list(POP_FRONT pending dir)
    get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
    list(APPEND pending ${subdirs})
    get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
    foreach(target IN LISTS targets)
      get_target_property(type ${target} TYPE)
      if(target MATCHES "^duet_" AND type MATCHES "LIBRARY$")
        list(APPEND libraries ${target})
      endif()
    endforeach()
  endwhile()

  foreach(library IN LISTS libraries)
    if(NOT DEFINED layer_of_${library})
      message(FATAL_ERROR "layering: library ${library} has no layer in cmake/DuetLayering.cmake")
    endif()
    get_target_property(links ${library} LINK_LIBRARIES)
    if(NOT links)
      continue()
    endif()
    foreach(link IN LISTS links)
      if(TARGET ${link} AND link MATCHES "^duet_" AND NOT layer_of_${link} LESS layer_of_${library})
        message(FATAL_ERROR "layering: ${library} (layer ${layer_of_${library}}) links ${link} "
                            "(layer ${layer_of_${link}}); a library links only lower layers")
      endif()
    endforeach()
  endforeach()
endfunction()
